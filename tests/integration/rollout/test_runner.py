"""The rollout runner end to end: real engine, real proxy, real Kafka, the runner as a process.

One engine and one proxy subprocess per module, on fresh topics. Each test runs
``python -m services.rollout`` with ``REIN_MAX_GROUPS`` so it exits by itself, then
reads every record back and checks it against the task: the runner's rewards must be
exactly what the task computes for the transcript the chunks record.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient

from ops.local.ports import free_port
from services.rollout.task import NumberGuessTask
from shared.bus import create_topics
from shared.codec import decode, encode
from shared.names import RedisKeys, Topics
from shared.schemas import (
    BatchSkipped,
    Chunk,
    GroupDispatched,
    Record,
    RetryRequest,
    SessionFinished,
    SessionRejected,
    WeightApplied,
)
from shared.tokenizer import TOKENIZER
from tests.support.procs import REPO_ROOT
from tests.support.rebalance import ForeignMember
from tests.support.stack import engine_and_proxy

pytestmark = pytest.mark.integration

RUN_TIMEOUT_S = 200
"""Bound on one runner run; covers a slow first consumer-group join on a loaded machine (startup 120 s)."""


@dataclass
class Stack:
    bootstrap: str
    topics: Topics
    proxy_url: str
    log_dir: Path
    redis_url: str
    runner_token: str


@pytest.fixture(scope="module")
def stack(
    kafka_bootstrap: str, kafka_admin: KafkaAdminClient, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(chunks=f"t.rollout.chunks.{suffix}", events=f"t.rollout.events.{suffix}")
    names = [topics.chunks, topics.events]
    create_topics(kafka_admin, dict.fromkeys(names, 4))
    logs = tmp_path_factory.mktemp("rollout-logs")
    with engine_and_proxy(
        kafka_bootstrap, topics, tmp_path_factory.mktemp("weights"), logs,
        admin_token="rollout-test-token", engine_env={"REIN_SEED": "3"},
    ) as (_engine, proxy):
        yield Stack(kafka_bootstrap, topics, proxy.url, logs, redis_url, proxy.runner_token)


def _runner_env(stack: Stack, group: str, retries: str, weights: str, **extra: str) -> dict[str, str]:
    """The runner's environment; ``retries`` / ``weights`` are the test's own topics (the runner
    reads them from the beginning, so records of another test must not be there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")}
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
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
    )
    env.update(extra)
    return env


def _start_runner(stack: Stack, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = stack.log_dir / f"rollout-{uuid.uuid4().hex[:6]}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return proc, log_path


@contextmanager
def _running(stack: Stack, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A runner process and its log, killed on the way out if it is still running."""
    proc, log_path = _start_runner(stack, env)
    try:
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _health(port: int) -> dict[str, Any] | None:
    """The runner's ``/health`` body; None while it does not answer."""
    try:
        body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
    except httpx.HTTPError:
        return None
    return body


def _wait_exit(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = RUN_TIMEOUT_S) -> None:
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"runner did not exit within {timeout_s}s; log:\n{log_path.read_text()[-4000:]}")
    assert code == 0, f"runner exited {code}; log:\n{log_path.read_text()[-4000:]}"


def _read_all(bootstrap: str, topic: str, timeout_s: float = 30) -> list[Any]:
    """Every record now on ``topic`` (all partitions, from the beginning), in (partition, offset) order."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} to its end within {timeout_s}s"
            for batch in consumer.poll(timeout_ms=500).values():
                out.extend(decode(m.value) for m in batch)
        return out
    finally:
        consumer.close()


def _produce(bootstrap: str, topic: str, record: Record, partition: int | None = None) -> tuple[int, int]:
    """Publish one record (acks=all; to ``partition``, else by its key); its (partition, offset)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        meta = producer.send(topic, key=record.key().encode(), value=encode(record), partition=partition).get(30)
    finally:
        producer.close(timeout=10)
    return meta.partition, meta.offset


def _wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


def _check_groups(stack: Stack, dispatched: list[GroupDispatched]) -> None:
    """Every session of every group: chunks present, finished once, reward = the task's replay."""
    events = _read_all(stack.bootstrap, stack.topics.events)
    chunks = [c for c in _read_all(stack.bootstrap, stack.topics.chunks) if isinstance(c, Chunk)]
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


def _dispatched(stack: Stack) -> list[GroupDispatched]:
    events = _read_all(stack.bootstrap, stack.topics.events)
    return sorted((e for e in events if isinstance(e, GroupDispatched)), key=lambda e: e.ts)


def test_two_groups_of_four(stack: Stack, unique_group: str, unique_topic: Callable[..., str]) -> None:
    before = {g.group_id for g in _dispatched(stack)}
    env = _runner_env(stack, unique_group, unique_topic(), unique_topic(), REIN_MAX_GROUPS="2", REIN_SEED="5")
    proc, log_path = _start_runner(stack, env)
    _wait_exit(proc, log_path)
    new = [g for g in _dispatched(stack) if g.group_id not in before]
    prompts = NumberGuessTask().prompts(5)
    expected = [next(prompts), next(prompts)]
    assert sorted((g.prompt_id, g.attempt) for g in new) == sorted((p.prompt_id, 0) for p in expected)
    assert {g.prompt_id: g.prompt for g in new} == {p.prompt_id: p.payload for p in expected}
    _check_groups(stack, new)


def test_a_restarted_runner_continues_its_prompt_stream(
    stack: Stack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    """The prompt cursor is durable: a second run with the same seed (a restart) dispatches the next
    prompts of the stream, never one of the first run's."""
    before = {g.group_id for g in _dispatched(stack)}
    env = _runner_env(stack, unique_group, unique_topic(), unique_topic(), REIN_MAX_GROUPS="2", REIN_SEED="11")
    for _ in range(2):
        proc, log_path = _start_runner(stack, env)
        _wait_exit(proc, log_path)
    new = [g for g in _dispatched(stack) if g.group_id not in before]
    prompts = NumberGuessTask().prompts(11)
    expected = [next(prompts).prompt_id for _ in range(4)]
    assert sorted(g.prompt_id for g in new) == sorted(expected)
    assert all(g.attempt == 0 for g in new)


def test_retry_request_is_dispatched_first_with_its_attempt(
    stack: Stack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    retries = unique_topic()
    before = {g.group_id for g in _dispatched(stack)}
    payload = {"task": "guess_number", "secret": 9, "low": 0, "high": 15, "max_turns": 5}
    retry = RetryRequest(
        prompt_id=f"gn-retry-{uuid.uuid4().hex[:6]}", attempt=2, previous_group_id="g-old", prompt=payload
    )
    partition, offset = _produce(stack.bootstrap, retries, retry)
    env = _runner_env(stack, unique_group, retries, unique_topic(), REIN_MAX_GROUPS="2", REIN_SEED="6")
    proc, log_path = _start_runner(stack, env)
    _wait_exit(proc, log_path)
    new = [g for g in _dispatched(stack) if g.group_id not in before]
    assert len(new) == 2
    first = new[0]
    assert (first.prompt_id, first.attempt, first.prompt) == (retry.prompt_id, 2, payload), "retry has priority"
    assert new[1].attempt == 0
    _check_groups(stack, new)
    # The retry's offset was committed once its group was dispatched.
    reader = KafkaConsumer(bootstrap_servers=stack.bootstrap, group_id=unique_group, enable_auto_commit=False)
    try:
        assert reader.committed(TopicPartition(retries, partition)) == offset + 1
    finally:
        reader.close()


@pytest.mark.parametrize("release", ["weight_applied", "batch_skipped"])
def test_sync_mode_waits_for_a_new_weight_version(
    stack: Stack, unique_group: str, unique_topic: Callable[..., str], release: str
) -> None:
    """The next wave opens on a new applied version, or on a batch the trainer consumed without one."""
    before = {g.group_id for g in _dispatched(stack)}
    port, weights = free_port(), unique_topic()
    env = _runner_env(
        stack,
        unique_group,
        unique_topic(),
        weights,
        REIN_MAX_GROUPS="2",
        REIN_SEED="7",
        REIN_MODE="sync",
        REIN_GROUPS_PER_STEP="1",
        REIN_METRICS_PORT=str(port),
    )
    with _running(stack, env) as (proc, log_path):

        def waiting() -> dict[str, Any] | None:
            body = _health(port)
            return body if body and body.get("waiting_for_weights") else None

        state = _wait_for(waiting, 60, "the runner to wait for weights after its first wave")
        assert (state["dispatched"], state["in_flight"]) == (1, 0)
        assert len([g for g in _dispatched(stack) if g.group_id not in before]) == 1
        opens: Record = (
            WeightApplied(version="v-test", seq=state["weights_seq"] + 1, digest="d") if release == "weight_applied"
            else BatchSkipped(index=0, batch_id="b-test", reason="no_signal", version="v0")
        )
        _produce(stack.bootstrap, weights, opens)
        _wait_exit(proc, log_path)
    new = [g for g in _dispatched(stack) if g.group_id not in before]
    assert len(new) == 2
    _check_groups(stack, new)


def test_async_pacing_starts_prompts_only_while_the_window_can_train_them(
    stack: Stack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    """keep_versions 1, batch_groups 2: two prompts start, then nothing until the trainer's progress
    (a WeightApplied's last_index, a BatchSkipped) or a final drop frees places; retries are not paced."""
    before = {g.group_id for g in _dispatched(stack)}
    port, weights, retries = free_port(), unique_topic(), unique_topic()
    keys = RedisKeys(f"t-{unique_group}")
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    client.hset(keys.window_config, mapping={"keep_versions": "1", "batch_groups": "2", "max_retries": "2",
                                             "max_free_retries": "10"})
    env = _runner_env(stack, unique_group, retries, weights, REIN_MAX_GROUPS="7", REIN_SEED="13",
                      REIN_METRICS_PORT=str(port))

    def settled(dispatched: int) -> Callable[[], dict[str, Any] | None]:
        def check() -> dict[str, Any] | None:
            body = _health(port)
            return body if body and body["dispatched"] == dispatched and body["in_flight"] == 0 else None
        return check

    def new() -> list[GroupDispatched]:
        return [g for g in _dispatched(stack) if g.group_id not in before]

    try:
        with _running(stack, env) as (proc, log_path):
            state = _wait_for(settled(2), 60, "the first two groups to end")
            assert state["pacing"] == {"live": 2, "capacity": 2, "consumed_index": -1}
            _wait_for(lambda: _pacing_held(port), 10, "the pacing gauge to say held")
            assert len(new()) == 2  # held: nothing more starts while the trainer has consumed nothing
            _produce(stack.bootstrap, weights, WeightApplied(version="v-1", seq=1, digest="d", last_index=0))
            _wait_for(settled(4), 60, "two more groups after batch 0 was consumed")
            _produce(stack.bootstrap, weights, BatchSkipped(index=1, batch_id="b-1", reason="no_signal", version="v-1"))
            _wait_for(settled(6), 60, "two more groups after batch 1 was skipped")
            client.hset(keys.window, "drops_total", "1")  # the window dropped one prompt for good
            # The seventh group is the last (REIN_MAX_GROUPS): the runner exits after it, so its health
            # may be gone before a poll sees it settled; the exit is what to await (then 7 groups below).
            _wait_exit(proc, log_path, timeout_s=60)
    finally:
        client.close()
    groups = new()
    assert len(groups) == 7 and all(g.attempt == 0 for g in groups)
    _check_groups(stack, groups)


def _pacing_held(port: int) -> bool:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return False
    return "rein_rollout_pacing_held 1.0" in text


def test_sigterm_drains_in_flight_groups_and_exits_zero(
    stack: Stack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    before = {g.group_id for g in _dispatched(stack)}
    port = free_port()
    env = _runner_env(
        stack,
        unique_group,
        unique_topic(),
        unique_topic(),
        REIN_SEED="8",
        REIN_MAX_CONCURRENT_GROUPS="2",
        REIN_METRICS_PORT=str(port),
    )
    with _running(stack, env) as (proc, log_path):
        _wait_for(lambda: int((_health(port) or {}).get("dispatched", 0)) >= 3, 60,
                  "the unbounded runner to dispatch a few groups")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert "rein_rollout_groups_in_flight" in metrics and "rein_rollout_episodes_total" in metrics
        proc.terminate()
        _wait_exit(proc, log_path, timeout_s=60)
    new = [g for g in _dispatched(stack) if g.group_id not in before]
    assert len(new) >= 3
    _check_groups(stack, new)  # every dispatched group ran to its end before the exit


N_RETRIES = 60


def test_retry_group_rebalances_lose_and_repeat_no_retry(
    stack: Stack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    """A make-test failure once: retries queued in the runner while its retry group rebalances.

    Sixty retries, fifteen per partition, dispatched one group at a time (about 0.2 s each, so
    the queue outlasts a rebalance); a foreign member joins the runner's group while retries are
    queued (the runner's partitions are revoked and given back, so queued retries are delivered
    again) and leaves (they move once more). The runner must stay alive, dispatch every retry
    exactly once, and commit every retry record."""
    retries = unique_topic(4)
    before = {g.group_id for g in _dispatched(stack)}
    payload = {"task": "guess_number", "secret": 9, "low": 0, "high": 15, "max_turns": 5}
    tag = uuid.uuid4().hex[:6]
    wanted = []
    for i in range(N_RETRIES):
        retry = RetryRequest(prompt_id=f"rb-{tag}-{i}", attempt=1, previous_group_id="g-old", prompt=payload)
        _produce(stack.bootstrap, retries, retry, partition=i % 4)
        wanted.append(retry.prompt_id)
    port = free_port()
    env = _runner_env(stack, unique_group, retries, unique_topic(), REIN_SEED="9",
                      REIN_MAX_CONCURRENT_GROUPS="1", REIN_METRICS_PORT=str(port))
    with _running(stack, env) as (proc, log_path):

        def health() -> dict[str, Any]:
            body = _health(port)
            if body is None:
                return {}
            assert proc.poll() is None, f"runner died; log:\n{log_path.read_text()[-4000:]}"
            return body

        def retries_dispatched() -> Counter[str]:
            assert proc.poll() is None, f"runner died; log:\n{log_path.read_text()[-4000:]}"
            return Counter(g.prompt_id for g in _dispatched(stack) if g.group_id not in before and g.attempt == 1)

        _wait_for(lambda: health().get("dispatched", 0) >= 1 and health().get("pending_retries", 0) >= 4, 90,
                  "a retry dispatched while others are queued")
        with ForeignMember(stack.bootstrap, unique_group, [retries]) as member:
            _wait_for(lambda: member.records > 0 or len(retries_dispatched()) == N_RETRIES, 30,
                      "the foreign member to read retries of its partitions")
        _wait_for(lambda: len(retries_dispatched()) == N_RETRIES, 180, "every retry dispatched")
        assert proc.poll() is None, f"runner died; log:\n{log_path.read_text()[-4000:]}"

        def all_committed() -> bool:
            reader = KafkaConsumer(bootstrap_servers=stack.bootstrap, group_id=unique_group,
                                   enable_auto_commit=False)
            try:
                tps = [TopicPartition(retries, p) for p in range(4)]
                return all(reader.committed(tp) == N_RETRIES // 4 for tp in tps)
            finally:
                reader.close()

        _wait_for(all_committed, 30, "every retry record committed")
        proc.terminate()
        _wait_exit(proc, log_path, timeout_s=60)
    dispatched = Counter(g.prompt_id for g in _dispatched(stack) if g.group_id not in before and g.attempt == 1)
    assert dispatched == Counter(dict.fromkeys(wanted, 1)), "each retry dispatched exactly once"
    log_text = log_path.read_text()
    assert "retries_revoked" in log_text, "the runner's retry partitions were revoked at least once"
