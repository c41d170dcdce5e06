"""Faults during a run: rebalances, kill -9 of each service in turn, a Kafka and a Redis crash, a lost registry.

One run of the local stack (the processes ``make demo`` starts). After the first
training step, one fault at a time; after each, the run must make training progress
again before the next. Then the topics and Redis are read back and checked
independently of the services' own bookkeeping: every manifest trained once, no group
in two manifests, every kept group accounted for, and every group that was open when
the proxy or the rollout runner died decided (its sessions rejected, never left open).

The trainer's own kill -9 is in ``test_closed_loop.py``. Figures go to
``faults.json`` in the run directory and are printed (``-s``) for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from ops.local.launcher import Service
from ops.local.stack import LocalStack, start
from shared.bus import read_topic
from shared.names import RedisKeys, Topics
from shared.schemas import DecisionRecord, GroupDispatched, SessionRejected
from shared.settings import KafkaSettings
from tests.support.fault_runs import (
    PROGRESS_TIMEOUT_S,
    assert_registry_matches_weights,
    proxy_state,
    wait_trained,
)
from tests.support.readback import (
    assert_every_manifest_trained_once,
    assert_groups_accounted_for,
    batches_made,
    small_stack,
    stop_and_read,
    trained_steps,
)
from tests.support.rebalance import ForeignMember
from tests.support.wait import wait_on_stack

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]

EXTRA_STEPS = 2
"""Training steps required after the last fault, before the run is stopped and read back."""
FAULTS = ("rebalance", "rollout", "collector-0", "broadcaster", "proxy", "engine", "kafka", "redis", "registry")
"""In this order. After each, a batch made after the fault must be trained before the next."""
REBALANCE_HOLD_S = 5.0
"""How long a foreign member stays in each consumer group (collectors, trainer, broadcaster, runner)."""
GROUPS = {
    "rein-collector": ("rollout.chunks", "rollout.events"),
    "rein-trainer": ("train.batches",),
    "rein-weight-broadcaster": ("weights",),
    "rein-rollout": ("rollout.retries",),
}
DOWN_S = 5.0
"""How long Kafka and Redis stay down when they are killed."""
SESSION_IDLE_S = 3.0
"""The proxy's idle timeout here: sessions of the killed runner are rejected this long after their last call."""
INCOMPLETE_S = 60.0
"""The collectors' incomplete timeout here: a group of the killed runner that never reached the proxy
is failed (and retried) after it. Above the Kafka crash's recovery time, so no live group is cut."""


def _service(local: LocalStack, name: str) -> Service:
    return next(s for s in local.stack.services if s.name == name)


def _kill_and_restart(local: LocalStack, name: str, while_down: Callable[[], None] = lambda: None) -> None:
    svc = _service(local, name)
    assert svc.proc is not None and svc.alive(), f"{name} was not running before its fault"
    svc.proc.kill()
    svc.proc.wait(timeout=30)
    while_down()
    svc.start()
    svc.wait_healthy(timeout_s=120)


def _live_sessions(local: LocalStack) -> int:
    return int(proxy_state(local, "proxy")["live_sessions"])


def _freeze_with_live_sessions(local: LocalStack, name: str) -> None:
    """Stop ``name`` (SIGSTOP) at a moment the proxy holds sessions: frozen, the runner finishes none of them
    (its kill leaves them to the proxy's idle timeout), and a frozen proxy ends none (its kill loses them).
    A frozen runner is checked again: its last sessions could have finished between the read and the signal
    (a frozen proxy cannot be asked; two sessions at the read leave it the same margin)."""
    proc = _service(local, name).proc
    assert proc is not None

    def frozen_with_sessions() -> bool:
        if _live_sessions(local) < 2:
            return False
        proc.send_signal(signal.SIGSTOP)
        if name == "proxy" or _live_sessions(local) > 0:
            return True
        proc.send_signal(signal.SIGCONT)
        return False

    wait_on_stack(f"the proxy holding sessions of a frozen {name}", frozen_with_sessions, PROGRESS_TIMEOUT_S,
                  local, interval_s=0.05)


def _has_members(client: redis.Redis, key: str) -> bool:
    return bool(client.zcard(key) > 0)


def _dispatched(kafka: KafkaSettings) -> set[str]:
    return {r.group_id for r in read_topic(kafka, Topics().events, 60) if isinstance(r, GroupDispatched)}


def _decided(kafka: KafkaSettings) -> set[str]:
    return {d.group_id for d in read_topic(kafka, Topics().decisions, 60) if isinstance(d, DecisionRecord)}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Unbounded steps: the test stops the trainer once every fault is behind it. Groups without signal are
    # kept (small_stack): six-token replies mostly score alike, and dropping them as groups without signal
    # (tested in tests/integration/collector) made each trainer step wait for a rare group.
    config = small_stack(
        tmp_path_factory.mktemp("faults"),
        # Paced (the default): the proxy and the runner are each killed at a moment the proxy holds sessions.
        services={
            "rollout": {"max_tokens": 6},
            "broadcaster": {"reconcile_interval_s": 2},
            "proxy": {"session_idle_timeout_s": SESSION_IDLE_S},
            "collector": {"incomplete_timeout_s": INCOMPLETE_S},
        },
    )
    local = start(config)
    kafka = KafkaSettings(bootstrap_servers=local.infra.kafka_bootstrap)
    keys = RedisKeys()
    faults: list[dict[str, Any]] = []
    open_at: dict[str, set[str]] = {}
    try:
        wait_on_stack("trainer step 1", lambda: trained_steps(local) >= 1, PROGRESS_TIMEOUT_S, local)
        for fault in FAULTS:
            before = trained_steps(local)
            made = batches_made(local)  # manifests 0..made-1 exist; index `made` comes after the fault
            started = time.monotonic()
            if fault == "proxy":
                open_at[fault] = _dispatched(kafka)
            if fault == "rebalance":
                with contextlib.ExitStack() as members:
                    for group, topics in GROUPS.items():
                        members.enter_context(ForeignMember(local.infra.kafka_bootstrap, group, topics))
                    time.sleep(REBALANCE_HOLD_S)  # the fault is the members' stay; nothing to await
            elif fault in ("kafka", "redis"):
                local.infra.restart(fault, kill=True, down_s=DOWN_S)
            elif fault == "registry":
                client = redis.Redis.from_url(local.infra.redis_url, decode_responses=True)
                deleted = client.delete(keys.registry, keys.registry_order)
                assert deleted == 2
                try:
                    wait_on_stack("registry rebuilt from the weights topic",
                                  functools.partial(_has_members, client, keys.registry_order), 60, local)
                finally:
                    client.close()
            elif fault == "rollout":
                # Killed while the proxy holds sessions of it (frozen first: at an arbitrary moment, under
                # load, its open groups may have no session at the proxy yet). Read once the runner is dead:
                # a group it dispatched between a read before the kill and the kill itself would escape the
                # check (its sessions may never reach the proxy, so only the incomplete timeout ends it).
                def read_open() -> None:
                    open_at["rollout"] = _dispatched(kafka)

                _freeze_with_live_sessions(local, fault)
                _kill_and_restart(local, fault, read_open)
            elif fault == "proxy":
                _freeze_with_live_sessions(local, fault)
                _kill_and_restart(local, fault)
            else:
                _kill_and_restart(local, fault)
            injected_s = time.monotonic() - started
            wait_trained(local, made, f"a batch made after the {fault} fault")
            faults.append({"fault": fault, "steps_before": before, "fault_s": round(injected_s, 1),
                           "new_batch_trained_after_s": round(time.monotonic() - started, 1)})
        last = trained_steps(local) + EXTRA_STEPS
        wait_on_stack(f"trainer step {last}", lambda: trained_steps(local) >= last, PROGRESS_TIMEOUT_S, local)
        # Groups of the killed runner that never reached the proxy end only after the incomplete timeout.
        wait_on_stack("the groups open at the runner's kill decided", lambda: open_at["rollout"] <= _decided(kafka),
              INCOMPLETE_S + PROGRESS_TIMEOUT_S, local)
        metrics = {
            name: httpx.get(f"{local.urls[name]}/metrics", timeout=5).text
            for name in ("rollout", "proxy", "collector-0", "collector-1", "broadcaster")
        }
        data: dict[str, Any] = {**stop_and_read(local), "faults": faults, "open_at": open_at, "metrics": metrics}
    finally:
        local.stop()
    return data


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_fault_was_followed_by_training_progress(run: dict[str, Any]) -> None:
    assert [f["fault"] for f in run["faults"]] == list(FAULTS)
    rows = run["rows"]
    assert len(rows) >= len(FAULTS) + 1 + EXTRA_STEPS
    assert_every_manifest_trained_once(rows)


def test_no_group_is_trained_twice_and_every_kept_group_is_accounted_for(run: dict[str, Any]) -> None:
    assert_groups_accounted_for(run["batches"], run["decisions"], run["pending"])


def test_groups_open_when_the_proxy_died_were_all_decided(run: dict[str, Any]) -> None:
    decided = {d.group_id for d in run["decisions"] if isinstance(d, DecisionRecord)}
    open_groups = run["open_at"]["proxy"]
    assert open_groups, "no group had been dispatched before the proxy was killed"
    undecided = sorted(open_groups - decided)
    assert not undecided, f"{len(undecided)} groups open at the proxy crash were never decided: {undecided[:5]}"
    lost = [r for r in run["events"] if isinstance(r, SessionRejected) and r.error == "session_lost"]
    assert lost, "the proxy crash left no session_lost rejection: its open sessions were not ended"
    assert _metric(run["metrics"]["rollout"], "rein_rollout_lost_sessions_total") == len(lost)


def test_groups_open_when_the_runner_died_were_all_decided_and_retried(run: dict[str, Any]) -> None:
    """The killed runner's sessions were rejected by the proxy when idle; nothing waited forever."""
    open_groups = run["open_at"]["rollout"]
    assert open_groups, "no group had been dispatched before the runner was killed"
    decisions = [d for d in run["decisions"] if isinstance(d, DecisionRecord)]
    undecided = sorted(open_groups - {d.group_id for d in decisions})
    assert not undecided, f"{len(undecided)} groups open at the runner's kill were never decided: {undecided[:5]}"
    # (Sessions of a live runner can go idle too, when their finish failed while Kafka was down.)
    idle = [r for r in run["events"] if isinstance(r, SessionRejected) and r.error == "session_idle"]
    orphaned = {r.group_id for r in idle} & open_groups
    assert orphaned, "the runner's kill left no session_idle rejection: its open sessions were not ended"
    failed = {d.group_id for d in decisions if d.decision in ("failed_retry", "failed_dropped")}
    assert orphaned <= failed, "a group with an idle-rejected session was not decided as failed"


def test_registry_was_rebuilt_in_order_after_redis_lost_it(run: dict[str, Any]) -> None:
    assert_registry_matches_weights(run)
    rebuilds = sum(_metric(run["metrics"][c], "rein_collector_registry_rebuilds_total")
                   for c in ("collector-0", "collector-1"))
    assert rebuilds >= 1


def test_report_figures(run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Not a check: writes and prints the figures docs/reliability.md quotes."""
    decisions = Counter(d.decision for d in run["decisions"] if isinstance(d, DecisionRecord))
    lost = [r for r in run["events"] if isinstance(r, SessionRejected) and r.error == "session_lost"]
    summary = {
        "faults": run["faults"],
        "steps": len(run["rows"]),
        "decisions": dict(decisions),
        "session_lost_rejections": len(lost),
        "groups_open_at_proxy_kill": len(run["open_at"]["proxy"]),
        "groups_open_at_runner_kill": len(run["open_at"]["rollout"]),
        "session_idle_rejections": sum(
            1 for r in run["events"] if isinstance(r, SessionRejected) and r.error == "session_idle"
        ),
        "groups_failed_incomplete": sum(
            _metric(run["metrics"][c], 'rein_collector_abandoned_groups_total{outcome="failed"')
            for c in ("collector-0", "collector-1")
        ),
        "dependency_errors": {
            name: _metric(run["metrics"][name], f"rein_{name.split('-')[0]}_dependency_errors_total")
            for name in ("collector-0", "collector-1", "broadcaster")
        },
        "reconciles": _metric(run["metrics"]["broadcaster"], "rein_broadcaster_reconciles_total"),
    }
    out = tmp_path_factory.mktemp("faults-report") / "faults.json"
    out.write_text(json.dumps(summary, indent=2))
    print("\nfault figures:", json.dumps(summary, indent=2))
    assert summary["steps"] == len(run["rows"])


def test_restarts_resume_the_prompt_stream_and_never_repeat_a_prompt(run: dict[str, Any]) -> None:
    """The runner was killed and restarted: it continued its seed's stream from the durable cursor, so
    no prompt the killed runner had dispatched new (attempt 0, no retry) was dispatched new again."""
    before_kill = run["open_at"]["rollout"]
    new = [r for r in run["events"] if isinstance(r, GroupDispatched) and r.attempt == 0 and r.free_retries == 0]
    old_prompts = {r.prompt_id for r in new if r.group_id in before_kill}
    after = {r.prompt_id for r in new if r.group_id not in before_kill}
    assert old_prompts and after, "the runner dispatched new prompts both before and after its kill"
    repeated = sorted(old_prompts & after)
    assert not repeated, f"prompts of the killed runner dispatched new again after its restart: {repeated[:5]}"
