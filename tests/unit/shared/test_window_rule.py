"""The batch window's rule (``shared/window_rule.py``), replayed group by group: groups dropped as the
window slides (at once or retroactively), failed groups retried then dropped, batches with their gaps,
drops and token tallies, groups without signal, and as properties that a group inside the newest
``keep_versions`` is never dropped and that every group gets exactly one final outcome."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.staleness import (
    Decision,
    NoSignalGroups,
    TokenTally,
    WindowGroup,
    WindowSettings,
    WindowState,
    next_attempt,
)
from shared.versions import VersionRegistry
from shared.window_rule import WindowReplay, window_step


def _registry(n: int) -> VersionRegistry:
    reg = VersionRegistry()
    for i in range(n):
        reg.publish(f"v{i}", i)
    return reg


def _group(
    gid: str, *versions: str, failed: bool = False, attempt: int = 0, signal: bool = True, tokens: int = 0
) -> WindowGroup:
    return WindowGroup(gid, f"p-{gid}", attempt, failed, tuple(versions), signal=signal, tokens=tokens)


def _run(keep: int, groups: list[WindowGroup], batch: int = 100, n: int = 10) -> WindowReplay:
    replay = WindowReplay(WindowSettings(keep_versions=keep, batch_groups=batch), _registry(n).index)
    for g in groups:
        replay.feed(g)
    return replay


def test_sliding_window_drops_old_groups() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=2, batch_groups=100), _registry(5).index)
    assert [d.decision for d in replay.feed(_group("a", "v0")).decisions] == [Decision.KEPT]
    assert [d.decision for d in replay.feed(_group("b", "v1")).decisions] == [Decision.KEPT]
    moved = replay.feed(_group("c", "v2"))
    assert [(d.group_id, d.decision) for d in moved.decisions] == [
        ("a", Decision.DROPPED_RETROACTIVE),
        ("c", Decision.KEPT),
    ]
    assert [d.decision for d in replay.feed(_group("d", "v0")).decisions] == [Decision.DROPPED_STALE]
    assert [g.group_id for g in replay.state.pending] == ["b", "c"]


def test_retroactive_removal_only_when_window_advances() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=1, batch_groups=100), _registry(5).index)
    replay.feed(_group("a", "v1"))
    same = replay.feed(_group("b", "v1"))
    assert not same.advanced and [d.decision for d in same.decisions] == [Decision.KEPT]
    moved = replay.feed(_group("c", "v2"))
    assert moved.advanced
    assert [(d.group_id, d.decision) for d in moved.decisions] == [
        ("a", Decision.DROPPED_RETROACTIVE),
        ("b", Decision.DROPPED_RETROACTIVE),
        ("c", Decision.KEPT),
    ]
    assert [g.group_id for g in replay.state.pending] == ["c"]


def test_late_straggler_with_older_published_label_is_stale_and_does_not_move_window() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=1, batch_groups=100), _registry(5).index)
    replay.feed(_group("new", "v3"))
    late = replay.feed(_group("late", "v1"))
    assert not late.advanced
    assert late.decisions[-1].decision == Decision.DROPPED_STALE
    assert replay.state.current == "v3"
    assert [g.group_id for g in replay.state.pending] == ["new"]


def test_failed_group_never_moves_window_and_retries_then_drops() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=1, batch_groups=100, max_retries=2), _registry(5).index)
    replay.feed(_group("a", "v1"))
    r0 = replay.feed(_group("f0", "v4", failed=True, attempt=0))
    r2 = replay.feed(_group("f2", "v4", failed=True, attempt=2))
    assert r0.decisions[0].decision == Decision.FAILED_RETRY
    assert r2.decisions[0].decision == Decision.FAILED_DROPPED
    assert replay.state.current == "v1"
    assert replay.state.drops_total == 1
    assert [g.group_id for g in replay.state.pending] == ["a"]


def test_batch_taken_with_gap_and_drops_since_last_batch() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=2, batch_groups=2), _registry(5).index)
    replay.feed(_group("a", "v0"))
    replay.feed(_group("b", "v2"))  # drops a retroactively
    res = replay.feed(_group("c", "v1", "v2"))
    assert res.batch is not None
    assert [g.group_id for g in res.batch.groups] == ["b", "c"]
    assert res.batch.dropped == (("a", "dropped_retroactive"),)
    assert res.batch.window.current_index == 2 and res.batch.window.cutoff_index == 1
    assert res.batch.gap is not None and (res.batch.gap.min, res.batch.gap.max) == (0, 1)
    assert replay.state.pending == () and replay.state.dropped_since_batch == ()
    assert res.batch.index == 0 and replay.state.batches == 1


def test_unversioned_group_is_never_dropped() -> None:
    replay = _run(1, [_group("a", "v5"), _group("b")])
    assert [g.group_id for g in replay.state.pending] == ["a", "b"]


def test_window_off_keeps_everything_but_tracks_current() -> None:
    replay = _run(0, [_group("a", "v5"), _group("b", "v0")])
    assert len(replay.state.pending) == 2 and replay.state.current == "v5"


group_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 9), min_size=0, max_size=4), st.booleans(), st.booleans()),
    min_size=1,
    max_size=30,
)
"""Groups as (version indices, failed, signal)."""

policies = st.sampled_from(list(NoSignalGroups))


@given(group_strategy, st.integers(1, 5), st.integers(1, 4), policies)
def test_window_never_drops_group_within_newest_keep_versions(
    raw: list[tuple[list[int], bool, bool]], keep: int, batch_groups: int, policy: NoSignalGroups
) -> None:
    reg = _registry(10)
    replay = WindowReplay(WindowSettings(keep_versions=keep, batch_groups=batch_groups, no_signal_groups=policy),
                          reg.index)
    newest_seen = -1
    for i, (idxs, failed, signal) in enumerate(raw):
        group = _group(f"g{i}", *(f"v{x}" for x in idxs), failed=failed, signal=signal)
        result = replay.feed(group)
        if not failed and idxs:  # a group without signal moves the window too
            newest_seen = max(newest_seen, *idxs)
        for d in result.decisions:
            if d.decision in (Decision.DROPPED_STALE, Decision.DROPPED_RETROACTIVE):
                # A dropped group has a trajectory strictly older than the newest keep versions seen.
                assert min(reg.index(v) for v in d.versions) < newest_seen - keep + 1
        # Every pending group is inside the window at all times.
        current = replay.state.current
        if current is not None:
            cut = reg.index(current) - keep + 1
            assert all(reg.index(v) >= cut for g in replay.state.pending for v in g.versions)


FINAL_DROPS = {
    Decision.DROPPED_STALE, Decision.DROPPED_RETROACTIVE, Decision.FAILED_DROPPED, Decision.DROPPED_NO_SIGNAL
}


@given(group_strategy, st.integers(0, 3), st.integers(1, 4), policies)
def test_every_group_gets_exactly_one_final_outcome(
    raw: list[tuple[list[int], bool, bool]], keep: int, batch_groups: int, policy: NoSignalGroups
) -> None:
    replay = WindowReplay(WindowSettings(keep_versions=keep, batch_groups=batch_groups, max_retries=0,
                                         no_signal_groups=policy), _registry(10).index)
    outcomes: dict[str, list[str]] = {}
    listed: list[tuple[str, str]] = []  # drops as the manifests list them
    drops = 0
    signal_of = {f"g{i}": signal for i, (_, failed, signal) in enumerate(raw)}
    for i, (idxs, failed, signal) in enumerate(raw):
        result = replay.feed(_group(f"g{i}", *(f"v{x}" for x in idxs), failed=failed, signal=signal, tokens=i + 1))
        for d in result.decisions:
            if d.decision != Decision.KEPT:
                outcomes.setdefault(d.group_id, []).append(d.decision.value)
            drops += d.decision in FINAL_DROPS
            if d.decision is Decision.DROPPED_NO_SIGNAL:
                assert policy is NoSignalGroups.DROP and not signal_of[d.group_id]
        if result.batch is not None:
            assert result.batch.tokens == result.state.tokens
            assert len(result.batch.groups) == batch_groups
            if policy is NoSignalGroups.DROP:
                assert all(g.signal for g in result.batch.groups)
            listed.extend(result.batch.dropped)
            for g in result.batch.groups:
                outcomes.setdefault(g.group_id, []).append("batch")
    for g in replay.state.pending:
        outcomes.setdefault(g.group_id, []).append("pending")
    # Tokens (group i generated i + 1): every generated token is untrained by its drop's cause or kept.
    cause = {"dropped_stale": "window", "dropped_retroactive": "window", "dropped_no_signal": "no_signal",
             "failed_dropped": "failed", "batch": "kept", "pending": "kept"}
    by_cause = dict.fromkeys(["window", "no_signal", "failed", "withheld", "kept"], 0)
    for gid, v in outcomes.items():
        by_cause[cause[v[0]]] += int(gid[1:]) + 1
    tally = replay.state.tokens
    assert tally.generated == sum(i + 1 for i in range(len(raw))) == tally.untrained + by_cause.pop("kept")
    assert tally.by_cause() == by_cause
    assert sorted(outcomes) == sorted(f"g{i}" for i in range(len(raw)))
    assert all(len(v) == 1 for v in outcomes.values()), outcomes
    assert replay.state.drops_total == drops
    # Every final drop is listed once, in a manifest or still waiting for the next one.
    every_drop = sorted([*listed, *replay.state.dropped_since_batch])
    assert every_drop == sorted((gid, v[0]) for gid, v in outcomes.items() if v[0] in FINAL_DROPS)
    if policy is NoSignalGroups.KEEP:
        assert Decision.DROPPED_NO_SIGNAL.value not in {v[0] for v in outcomes.values()}


def test_token_tally_by_cause() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=1, batch_groups=2, max_retries=1), _registry(5).index)
    replay.feed(_group("a", "v1", tokens=10))  # kept
    replay.feed(_group("flat", "v1", signal=False, tokens=7))  # dropped_no_signal
    replay.feed(_group("f0", "v1", failed=True, tokens=3))  # failed_retry: the tokens are still lost
    replay.feed(_group("f1", "v1", failed=True, attempt=1, tokens=4))  # failed_dropped
    assert replay.state.tokens == TokenTally(generated=24, window=0, no_signal=7, failed=7)
    moved = replay.feed(_group("b", "v2", tokens=5))  # a (pending) dropped retroactively; b kept
    assert [(d.group_id, d.tokens) for d in moved.decisions] == [("a", 10), ("b", 5)]
    replay.feed(_group("late", "v0", tokens=2))  # dropped_stale
    assert replay.state.tokens == TokenTally(generated=31, window=12, no_signal=7, failed=7)
    res = replay.feed(_group("c", "v2", tokens=6))  # b and c batched: trained, not untrained
    assert res.batch is not None and res.batch.tokens == TokenTally(37, 12, 7, 7)
    assert res.batch.tokens.untrained == 26
    assert res.batch.tokens.by_cause() == {"window": 12, "no_signal": 7, "failed": 7, "withheld": 0}


@pytest.mark.parametrize(
    ("attempt", "free", "uncharged", "decision", "retry"),
    [
        (0, 0, False, Decision.FAILED_RETRY, (1, 0)),  # the prompt's own failure: one retry used
        (0, 0, True, Decision.FAILED_RETRY, (0, 1)),  # a dependency's: free
        (2, 0, True, Decision.FAILED_RETRY, (2, 1)),  # even on the last attempt
        (2, 0, False, Decision.FAILED_DROPPED, None),
        (2, 3, True, Decision.FAILED_DROPPED, None),  # free retries used up: it counts again
        (1, 3, True, Decision.FAILED_RETRY, (2, 3)),
    ],
)
def test_free_retries(
    attempt: int, free: int, uncharged: bool, decision: Decision, retry: tuple[int, int] | None
) -> None:
    config = WindowSettings(keep_versions=2, batch_groups=4, max_retries=2, max_free_retries=3)
    group = WindowGroup("g", "p", attempt, True, ("v1",), free_retries=free, uncharged=uncharged)
    result = window_step(WindowState(current="v1"), group, {"v1": 1}.__getitem__, config)
    assert [d.decision for d in result.decisions] == [decision]
    if retry is not None:
        assert next_attempt(group, config) == retry


def _signal_run(policy: NoSignalGroups, batch: int = 2) -> WindowReplay:
    return WindowReplay(WindowSettings(keep_versions=2, batch_groups=batch, no_signal_groups=policy),
                        _registry(5).index)


def test_group_without_signal_is_dropped_counted_and_listed_in_the_next_manifest() -> None:
    replay = _signal_run(NoSignalGroups.DROP)
    flat = replay.feed(_group("flat", "v1", signal=False))
    assert [(d.group_id, d.decision) for d in flat.decisions] == [("flat", Decision.DROPPED_NO_SIGNAL)]
    assert replay.state.pending == () and replay.state.drops_total == 1
    assert replay.state.dropped_since_batch == (("flat", "dropped_no_signal"),)
    replay.feed(_group("a", "v1"))
    res = replay.feed(_group("b", "v1"))
    assert res.batch is not None and [g.group_id for g in res.batch.groups] == ["a", "b"]
    assert res.batch.dropped == (("flat", "dropped_no_signal"),) and res.batch.drops_total == 1


def test_keep_policy_judges_a_group_without_signal_like_any_other() -> None:
    replay = _signal_run(NoSignalGroups.KEEP)
    assert [d.decision for d in replay.feed(_group("flat", "v1", signal=False)).decisions] == [Decision.KEPT]
    res = replay.feed(_group("a", "v1"))
    assert res.batch is not None and [g.group_id for g in res.batch.groups] == ["flat", "a"]
    assert replay.state.drops_total == 0


def test_group_without_signal_still_advances_the_window() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=1, batch_groups=100), _registry(5).index)
    replay.feed(_group("a", "v1"))
    moved = replay.feed(_group("flat", "v2", signal=False))
    assert moved.advanced and replay.state.current == "v2"
    assert [(d.group_id, d.decision) for d in moved.decisions] == [
        ("a", Decision.DROPPED_RETROACTIVE),
        ("flat", Decision.DROPPED_NO_SIGNAL),
    ]


def test_staleness_is_judged_before_signal() -> None:
    replay = WindowReplay(WindowSettings(keep_versions=1, batch_groups=100), _registry(5).index)
    replay.feed(_group("a", "v3"))
    late = replay.feed(_group("late", "v1", signal=False))
    assert [d.decision for d in late.decisions] == [Decision.DROPPED_STALE]


def test_no_signal_run_counts_groups_in_a_row_and_ignores_failed_ones() -> None:
    replay = _signal_run(NoSignalGroups.DROP, batch=100)
    runs = []
    for group in [
        _group("x", "v1", signal=False),
        _group("y", "v1", signal=False),
        _group("f", "v1", failed=True, signal=False),  # failed: judged as a failure, the run stays
        _group("z", "v0", signal=False),
        _group("ok", "v1"),
        _group("w", "v1", signal=False),
    ]:
        runs.append(replay.feed(group).state.no_signal_run)
    assert runs == [1, 2, 2, 3, 0, 1]


def test_failed_group_without_signal_is_retried_not_dropped_for_signal() -> None:
    replay = _signal_run(NoSignalGroups.DROP)
    result = replay.feed(_group("f", "v1", failed=True, signal=False))
    assert [d.decision for d in result.decisions] == [Decision.FAILED_RETRY]
