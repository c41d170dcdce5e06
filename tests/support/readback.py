"""Reading a stopped run back from Kafka and Redis, and the checks every fault scenario ends with.

Independent of the services' own bookkeeping: the topics and the window say what happened, and
these checks say it is consistent — every manifest trained once, no group in two manifests, no
group with contradicting decisions, every kept group trained or still pending.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ops.local.stack import LocalStack, StackConfig
from ops.report import optimizer_steps, rows_so_far
from ops.status_parts import kafka_part
from shared.bus import read_topic
from shared.membership import Members
from shared.schemas import BatchManifest, DecisionRecord
from shared.settings import KafkaSettings
from shared.state import client_for
from tests.support.wait import wait_on_stack

_ALLOWED = [
    {"kept"}, {"kept", "dropped_retroactive"}, {"dropped_stale"}, {"dropped_no_signal"}, {"failed_retry"},
    {"failed_dropped"},
]
"""The decision sets one group may have (a kept group may be dropped later when the window moves on)."""


def small_stack(run_dir: Path, services: dict[str, dict[str, Any]] | None = None, **fields: Any) -> StackConfig:
    """The local stack the fault scenarios run: the tiny policy, unbounded steps, two collectors, small
    groups and batches so that a step comes every few seconds, a span cap of 2; groups without signal are
    kept. ``services`` adds to (or overrides) these settings, service by service; ``fields`` are StackConfig's."""
    values: dict[str, dict[str, Any]] = {
        "rollout": {"group_size": 4, "max_concurrent_groups": 8}, "engine": {"step_delay_s": 0.01},
        "collector": {"no_signal_groups": "keep"}, "proxy": {"max_preempts": 2},
    }
    for name, given in (services or {}).items():
        values[name] = {**values.get(name, {}), **given}
    return StackConfig(run_dir=run_dir, **({"collectors": 2, "batch_groups": 4} | fields), services=values)


def engine_info(local: LocalStack, name: str = "engine") -> dict[str, Any]:
    """An engine's ``/get_model_info``: the version it serves and its digest."""
    info: dict[str, Any] = httpx.get(f"{local.urls[name]}/get_model_info", timeout=5).json()
    return info


def wait_bounded_run(local: LocalStack, steps: int, step_timeout_s: float, exit_timeout_s: float,
                     serve_timeout_s: float) -> dict[str, Any]:
    """A run with ``steps`` set: wait for that many optimizer steps (a batch without gradient is consumed
    without one), the trainer's exit after them and the engine serving ``v{steps}``; the engine's model info."""
    trainer = next(s for s in local.stack.services if s.name == "trainer")

    def wait(what: str, cond: Callable[[], bool], timeout_s: float) -> None:
        wait_on_stack(what, cond, timeout_s, local, allow_dead=("trainer",))  # the trainer exits at max_steps

    wait(f"trainer step {steps}", lambda: len(optimizer_steps(rows_so_far(local.trainer_metrics))) >= steps,
         step_timeout_s)
    wait("trainer exit after max_steps", lambda: not trainer.alive(), exit_timeout_s)
    wait(f"engine serving v{steps}", lambda: engine_info(local).get("weight_version") == f"v{steps}", serve_timeout_s)
    return engine_info(local)


def trained_steps(local: LocalStack) -> int:
    """Rows the trainer has written to its metrics (one per trained manifest)."""
    return len(rows_so_far(local.trainer_metrics))


def kill_replica(local: LocalStack, name: str, members: Members, survivors: list[str],
                 timeout_s: float, at_kill: Callable[[], Any] | None = None) -> dict[str, Any]:
    """SIGKILL replica ``name``, wait until ``members`` lists only ``survivors`` (its registration lapsed),
    then until two more manifests are trained. Returns seconds from the kill: ``lapsed_s``, ``two_steps_s``;
    with ``at_kill``, also what it returned (``at_kill``) when called as soon as the replica is dead."""
    victim = next(s for s in local.stack.services if s.name == name)
    assert victim.proc is not None
    before, t0 = trained_steps(local), time.monotonic()
    victim.proc.kill()
    victim.proc.wait(timeout=30)
    seen = None if at_kill is None else at_kill()
    wait_on_stack(f"{name}'s registration to lapse", lambda: members.live(forget=False) == sorted(survivors), 30,
                  local, allow_dead=(name,))
    lapsed_s = round(time.monotonic() - t0, 1)
    wait_on_stack(f"two steps without {name}", lambda: trained_steps(local) >= before + 2, timeout_s, local,
                  allow_dead=(name,))
    return {"lapsed_s": lapsed_s, "two_steps_s": round(time.monotonic() - t0, 1),
            **({} if at_kill is None else {"at_kill": seen})}


def trained_index(local: LocalStack) -> int:
    """Highest manifest index the trainer has trained (-1: none)."""
    return max((int(r["manifest_index"]) for r in rows_so_far(local.trainer_metrics)), default=-1)


def batches_made(local: LocalStack) -> int:
    """Manifests the collectors have made so far (the shared window's counter): the next one is made later."""
    client = client_for(local.infra.redis_settings())
    try:
        return int(client.hget(local.config.redis_keys.window, "batches") or 0)
    finally:
        client.close()


def collectors_caught_up(local: LocalStack, kafka: KafkaSettings) -> bool:
    """The collectors' consumer group has committed past every record on its topics: every group the
    runner ended is folded, written to ``rollout.groups``, decided by a window step and its outbox entries
    published (a collector commits a record only after all of that)."""
    group = local.config.setting("collector", "consumer_group")
    report = kafka_part(kafka, local.config.topics, {group: ["chunks", "events"]}, 10)
    return bool(report["groups"][group].get("lag") == 0)


def stop_and_read(local: LocalStack, allow_dead: tuple[str, ...] = ()) -> dict[str, Any]:
    """Stop the runner and the trainer (cleanly), then read a consistent picture: no new groups, every
    record the runner wrote taken by the collectors, then decisions -> pending -> manifests, with the
    outbox empty before each read (a kept group is pending, or its manifest is published).
    ``allow_dead``: services the scenario killed."""
    services = {s.name: s for s in local.stack.services}
    services["rollout"].stop(timeout_s=90)
    trainer = services["trainer"]
    trainer.stop(timeout_s=90)
    assert trainer.proc is not None and trainer.proc.returncode == 0, "the trainer did not stop cleanly"
    kafka = KafkaSettings(bootstrap_servers=local.infra.kafka_bootstrap)
    # Without this, a group the runner ended as it stopped can be on rollout.groups before its window step.
    wait_on_stack("the collectors to take every record", lambda: collectors_caught_up(local, kafka), 120, local,
                  allow_dead=("rollout", "trainer", *allow_dead))
    keys, topics = local.config.redis_keys, local.config.topics
    client = client_for(local.infra.redis_settings())  # the current primary, after a failover too
    try:
        def outbox_empty() -> bool:
            return client.llen(keys.outbox) == 0

        wait_on_stack("outbox drained", outbox_empty, 60, local, allow_dead=("rollout", "trainer", *allow_dead))
        decisions = read_topic(kafka, topics.decisions, 60)
        pending = set(client.lrange(keys.pending_order, 0, -1))
        wait_on_stack("outbox drained", outbox_empty, 60, local, allow_dead=("rollout", "trainer", *allow_dead))
        batches = read_topic(kafka, topics.batches, 60)
        registry = client.zrange(keys.registry_order, 0, -1, withscores=True)
    finally:
        client.close()
    return {
        "rows": rows_so_far(local.trainer_metrics),
        "events": read_topic(kafka, topics.events, 60),
        "batches": batches,
        "decisions": decisions,
        "weights": read_topic(kafka, topics.weights, 60),
        "pending": pending,
        "registry": registry,
    }


def assert_every_manifest_trained_once(rows: list[dict[str, Any]]) -> None:
    assert [int(r["manifest_index"]) for r in rows] == list(range(len(rows))), "a manifest skipped or trained twice"


def assert_groups_accounted_for(batches: list[Any], decisions: list[Any], pending: set[str]) -> None:
    """No group in two manifests, no contradicting decisions, every kept group trained or pending."""
    manifests: dict[int, BatchManifest] = {}
    for m in batches:
        if isinstance(m, BatchManifest):
            # A republished outbox entry is the same manifest again, never a different one under the index.
            assert manifests.setdefault(m.index, m).groups == m.groups, f"two different manifests with index {m.index}"
    in_manifests = Counter(ref.group_id for m in manifests.values() for ref in m.groups)
    twice = [g for g, n in in_manifests.items() if n > 1]
    assert not twice, f"groups in two manifests: {twice}"

    by_group: dict[str, set[str]] = defaultdict(set)
    for d in decisions:
        if isinstance(d, DecisionRecord):
            by_group[d.group_id].add(d.decision)
    odd = {g: sorted(ds) for g, ds in by_group.items() if ds not in _ALLOWED}
    assert not odd, f"groups with contradicting decisions: {odd}"
    for gid in in_manifests:
        assert "kept" in by_group[gid], f"{gid} was trained without a kept decision"
    lost = [gid for gid, ds in by_group.items() if ds == {"kept"} and gid not in in_manifests and gid not in pending]
    assert not lost, f"kept groups neither trained, nor dropped, nor pending: {lost}"
