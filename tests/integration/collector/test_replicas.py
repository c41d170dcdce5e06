"""Replicas: two collectors on one stream decide like one; kill -9 of one loses and duplicates nothing.

The stream is written in waves, each wave's decisions awaited before the next, so that
what one replica would decide does not depend on how partitions interleave; inside a
wave the groups are order-independent.
"""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from ops.local.ports import free_port
from ops.replay import GroupEvent, WeightEvent, group_event, replay
from services.collector.synthetic import group_records
from shared.schemas import CompletedGroup, DecisionRecord
from shared.staleness import NoSignalGroups, WindowSettings
from tests.support.collector import (
    Running,
    Source,
    Tail,
    env_of,
    final_decisions,
    make_settings,
    manifests_by_index,
    wait_settled,
)
from tests.support.procs import start_service

pytestmark = [pytest.mark.integration]


def _event(group_id: str, trajectories: list[list[str]], **kw: object) -> GroupEvent:
    """The replay view of a synthetic group (what the collector will assemble)."""
    from services.collector.assembly import Assembler, Position

    asm = Assembler()
    done: CompletedGroup | None = None
    for i, record in enumerate(group_records(group_id, trajectories, **kw)):  # type: ignore[arg-type]
        done = asm.add(Position("x", 0, i), record) or done
    assert done is not None
    return group_event(done)


SIG: dict[str, object] = {"rewards": [0.0, 1.0]}
"""Rewards that differ: the group carries signal (without, a synthetic group's rewards are all equal)."""
WAVES: list[list[tuple[str, list[list[str]], dict[str, object]]]] = [
    [(f"w1-{i}", [["v1"], ["v1"]], SIG) for i in range(8)] + [(f"n1-{i}", [["v1"], ["v1"]], {}) for i in range(3)],
    [(f"w2-{i}", [["v2"], ["v1"]], SIG) for i in range(4)]
    + [("fa", [["v2"], ["v2"]], {"attempt": 0, "rejected": [0]}), ("fb", [["v2"]], {"attempt": 2, "rejected": [0]})],
    [("x", [["v2"], ["v2"]], SIG)],
    [("y", [["v4"], ["v4"]], SIG)],  # advances to v4: x (v2) leaves retroactively
    # one trajectory each: no signal
    [(f"st-{i}", [["v0"], ["v4"]], {}) for i in range(3)] + [(f"w5-{i}", [["v4"]], {}) for i in range(3)],
]
LABELS = ["v0", "v1", "v2", "v3", "v4"]


def test_two_replicas_decide_like_one_and_never_disagree_about_the_window(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    settings = make_settings(
        kafka_bootstrap, redis_db_url, partitions=4, keep_versions=2, batch_groups=4, no_signal_groups="drop"
    )
    config = WindowSettings(keep_versions=2, batch_groups=4, max_retries=2, no_signal_groups=NoSignalGroups.DROP)
    expected = replay(
        [WeightEvent(v, i) for i, v in enumerate(LABELS)]
        + [_event(gid, trajs, **kw) for wave in WAVES for gid, trajs, kw in wave],
        config,
    )
    source = Source(settings, LABELS)
    r1 = settings.model_copy(update={"replica_id": "r1"})
    r2 = settings.model_copy(update={"replica_id": "r2"})
    with Running(r1) as one, Running(r2) as two:
        deadline = time.monotonic() + 60
        while len(one.collector.consumer.raw.assignment()) + len(two.collector.consumer.raw.assignment()) < 8 or not (
            one.collector.consumer.raw.assignment() and two.collector.consumer.raw.assignment()
        ):
            assert time.monotonic() < deadline, "the two replicas did not split the partitions"
            time.sleep(0.05)  # the group rebalances inside the replicas' own polls: nothing to await here
        decisions = Tail(settings, settings.topics.decisions)
        batches = Tail(settings, settings.topics.batches)
        seen: set[str] = set()
        for wave in WAVES:
            for gid, trajs, kw in wave:
                source.group(gid, trajs, **kw)  # type: ignore[arg-type]
            seen |= {gid for gid, _, _ in wave}
            decisions.wait(lambda rs, want=frozenset(seen): want <= set(final_decisions(rs)), f"wave {sorted(seen)}")
        live = decisions.wait(
            lambda rs: final_decisions(rs) == expected.decisions(), "the decisions one replica would make", 30
        )
        manifests = manifests_by_index(
            batches.wait(lambda rs: len(manifests_by_index(rs)) == expected.batches, "all manifests", 30)
        )
    assert final_decisions(live) == expected.decisions()
    assert "dropped_no_signal" in expected.decisions().values()
    assert sorted(manifests) == list(range(expected.batches))
    in_batches = [g.group_id for m in manifests.values() for g in m.groups]
    assert Counter(in_batches) == Counter(gid for gid, o in expected.outcomes.items() if o.batch is not None)
    records = [r for r in live if isinstance(r, DecisionRecord)]
    assert {r.collector for r in records} == {"r1", "r2"}  # both replicas decided groups
    by_step: dict[int, set[tuple[object, ...]]] = {}
    for r in records:
        assert r.step is not None
        by_step.setdefault(r.step, set()).add(tuple(r.window.model_dump().values()))
    assert all(len(windows) == 1 for windows in by_step.values()), "two windows at one step"
    assert sorted(by_step) == list(range(len(by_step))), "steps are one sequence shared by both replicas"
    current = {r.step: r.window.current_index for r in records}
    indices = [current[step] for step in sorted(current)]
    assert None not in indices, f"a decision without a current version: {indices}"
    assert indices == sorted(indices), f"the current version went back: {indices}"  # type: ignore[type-var]
    source.close()
    decisions.close()
    batches.close()


def test_kill_9_of_a_replica_mid_stream_loses_and_duplicates_no_group(
    kafka_bootstrap: str, redis_db_url: str, tmp_path: object
) -> None:
    settings = make_settings(
        kafka_bootstrap, redis_db_url, partitions=4, keep_versions=2, batch_groups=4, drain_interval_s=0.3
    )
    source = Source(settings, ["v0", "v1"])
    procs = []
    for name in ("ka", "kb"):
        port = free_port()
        env = env_of(settings) | {"REIN_REPLICA_ID": name, "REIN_METRICS_PORT": str(port)}
        procs.append(start_service("services.collector", env, f"http://127.0.0.1:{port}/health", timeout_s=60))
    victim, survivor = procs
    try:
        decisions = Tail(settings, settings.topics.decisions)
        batches = Tail(settings, settings.topics.batches)
        kept = [f"k{i:02d}" for i in range(40)]
        failed = [f"f{i}" for i in range(4)]
        for gid in kept[:20]:
            source.group(gid, [["v1"], ["v1"]])
        for gid in failed[:2]:
            source.group(gid, [["v1"]], attempt=2, rejected=[0])
        batches.wait(lambda rs: len(manifests_by_index(rs)) >= 2, "manifests before the kill")
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        for gid in kept[20:]:
            source.group(gid, [["v1"], ["v1"]])
        for gid in failed[2:]:
            source.group(gid, [["v1"]], attempt=2, rejected=[0])
        batches.wait(lambda rs: len(manifests_by_index(rs)) >= 10, "every kept group in a manifest", 90)
        decisions.wait(lambda rs: set(failed) <= set(final_decisions(rs)), "every failed group decided")
        wait_settled(settings, [batches, decisions])  # any duplicate publication is on the tails now
        manifests = manifests_by_index(batches.records)
        decided = decisions.records
        assert survivor.alive(), survivor.tail()
    finally:
        for proc in procs:
            proc.stop()
    assert sorted(manifests) == list(range(10))
    in_batches = Counter(g.group_id for m in manifests.values() for g in m.groups)
    assert set(in_batches) == set(kept) and set(in_batches.values()) == {1}
    final = final_decisions(decided)
    assert {gid: final[gid] for gid in failed} == dict.fromkeys(failed, "failed_dropped")
    assert all(final[gid] == "kept" for gid in kept)
    source.close()
    decisions.close()
    batches.close()
