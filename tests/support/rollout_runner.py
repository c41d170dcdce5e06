"""Harness of the rollout runner's integration tests (``tests/integration/rollout/``): the runner as a
process in front of a module's engine and proxy, its health and metrics read over HTTP, and the check
that every group it dispatched ran as the task says.

:func:`check_groups` replays the task on the transcript the chunk records hold: the runner's rewards
must be exactly what the task computes for it.
"""

from __future__ import annotations

import subprocess
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ops.local.launcher import Child, Service
from services.rollout.task import NumberGuessTask
from shared.names import Topics
from shared.schemas import Chunk, GroupDispatched, SessionFinished, SessionRejected
from shared.tokenizer import TOKENIZER
from tests.support.kafka_io import read_all
from tests.support.wait import wait_until

RUN_TIMEOUT_S = 200
"""Bound on one runner run; covers a slow first consumer-group join on a loaded machine (startup 120 s)."""


@dataclass
class RunnerStack:
    """The module's engine and proxy as the runner sees them: where to publish and whom to call."""

    bootstrap: str
    topics: Topics
    proxy_url: str
    log_dir: Path
    redis_url: str
    runner_token: str


def runner_env(stack: RunnerStack, group: str, retries: str, weights: str, **extra: str) -> dict[str, str]:
    """The runner's ``REIN_*`` variables; ``retries`` / ``weights`` are the test's own topics (the runner
    reads them from the beginning, so records of another test must not be there)."""
    env = {
        "REIN_PROXY_URL": stack.proxy_url,
        "REIN_RUNNER_TOKEN": stack.runner_token,
        "REIN_KAFKA__BOOTSTRAP_SERVERS": stack.bootstrap,
        "REIN_TOPICS__EVENTS": stack.topics.events,
        "REIN_TOPICS__CHUNKS": stack.topics.chunks,
        "REIN_TOPICS__RETRIES": retries,
        "REIN_TOPICS__WEIGHTS": weights,
        "REIN_RETRY_CONSUMER_GROUP": group,
        "REIN_REDIS__URL": stack.redis_url,
        "REIN_REDIS__KEY_PREFIX": f"t-{group}",  # a prompt cursor of the test's own
        "REIN_METRICS_PORT": "0",
        "REIN_GROUP_SIZE": "4",
        "REIN_REQUEST_TIMEOUT_S": "30",
        "REIN_STARTUP_TIMEOUT_S": "120",
    }
    env.update(extra)
    return env


def start_runner(stack: RunnerStack, env: dict[str, str]) -> tuple[Child, Path]:
    """``python -m services.rollout`` with ``env`` (the launcher adds the rest of this process's, minus ``REIN_*``)."""
    log_path = stack.log_dir / f"rollout-{uuid.uuid4().hex[:6]}.log"
    service = Service("rollout", "services.rollout", env, None, log_path, new_session=False)
    service.start()
    return service.process, log_path


@contextmanager
def running(stack: RunnerStack, env: dict[str, str]) -> Iterator[tuple[Child, Path]]:
    """A runner process and its log, killed on the way out if it is still running."""
    proc, log_path = start_runner(stack, env)
    try:
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def runner_health(port: int) -> dict[str, Any] | None:
    """The runner's ``/health`` body; None while it does not answer."""
    try:
        body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
    except httpx.HTTPError:
        return None
    return body


def pacing_held(port: int) -> bool:
    """Whether the runner's metrics say its async pacing holds new prompts back."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return False
    return "rein_rollout_pacing_held 1.0" in text


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """:func:`wait_until` every 0.2 s (each check reads the runner's HTTP or whole topics); what it returned."""
    return wait_until(condition, timeout_s, what, interval_s=0.2)


def wait_exit(proc: Child, log_path: Path, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Wait for the runner to exit by itself (killed and failed past ``timeout_s``); it must exit 0."""
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"runner did not exit within {timeout_s}s; log:\n{log_path.read_text()[-4000:]}")
    assert code == 0, f"runner exited {code}; log:\n{log_path.read_text()[-4000:]}"


def dispatched_groups(stack: RunnerStack) -> list[GroupDispatched]:
    """Every ``GroupDispatched`` now on the events topic, by time."""
    events = read_all(stack.bootstrap, stack.topics.events)
    return sorted((e for e in events if isinstance(e, GroupDispatched)), key=lambda e: e.ts)


def check_groups(stack: RunnerStack, dispatched: list[GroupDispatched]) -> None:
    """Every session of every group: chunks present, finished once, reward = the task's replay."""
    events = read_all(stack.bootstrap, stack.topics.events)
    chunks = [c for c in read_all(stack.bootstrap, stack.topics.chunks) if isinstance(c, Chunk)]
    finished = {e.session_id: e for e in events if isinstance(e, SessionFinished)}
    rejected = {e.session_id for e in events if isinstance(e, SessionRejected)}
    by_session: dict[str, list[Chunk]] = defaultdict(list)
    for c in chunks:
        by_session[c.session_id].append(c)
    task = NumberGuessTask()
    for group in dispatched:
        assert len(group.session_ids) == 4
        for sid in group.session_ids:
            assert sid not in rejected, "no weight update ran: nothing may be rejected"
            assert sid in finished, f"session {sid} of {group.group_id} never finished"
            fin = finished[sid]
            session_chunks = sorted(by_session[sid], key=lambda c: c.seq)
            assert session_chunks, f"no chunk records for {sid}"
            assert fin.group_id == group.group_id and fin.status == "completed"
            assert fin.num_chunks == len(session_chunks)
            assert all(c.group_id == group.group_id and c.ts >= group.ts for c in session_chunks)
            assert all(c.prompt_id == group.prompt_id and c.attempt == group.attempt for c in session_chunks)
            # The first context is exactly the task's opening message, then the assistant header.
            episode = task.episode()
            first = episode.reset(dict(group.prompt))
            assert session_chunks[0].context_ids == TOKENIZER.apply_chat_template(first, add_generation_prompt=True)
            # Replay the task on the recorded outputs, one chat call (turn) at a time.
            turns: dict[str, list[int]] = defaultdict(list)
            order: list[str] = []
            for c in session_chunks:
                if c.turn_id not in turns:
                    order.append(c.turn_id)
                turns[c.turn_id].extend(c.output_ids)
            feedback: list[dict[str, str]] | None = []
            for turn_id in order:
                assert feedback is not None, f"{sid}: a chat call after the episode ended"
                feedback = episode.step(TOKENIZER.decode(turns[turn_id]))
            assert feedback is None, f"{sid}: the episode did not end with its last recorded turn"
            assert fin.reward == pytest.approx(episode.reward()), (sid, [TOKENIZER.decode(turns[t]) for t in order])
