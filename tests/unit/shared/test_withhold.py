"""Withhold, don't drop (``StaleGroups.WITHHOLD``): a stale group keeps its members inside the window."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.staleness import Decision, NoSignalGroups, StaleGroups, TokenTally, WindowGroup, WindowSettings
from shared.version_window import SegmentEnd
from shared.versions import VersionRegistry
from shared.window_rule import WindowReplay, stale_members
from shared.window_view import window_group_from_samples


def _registry(n: int = 10) -> VersionRegistry:
    reg = VersionRegistry()
    for i in range(n):
        reg.publish(f"v{i}", i)
    return reg


def _group(gid: str, *members: tuple[str, int, int], signal: bool = True) -> WindowGroup:
    """``members``: (trajectory id, version index, trainable tokens)."""
    return WindowGroup(
        gid, f"p-{gid}", 0, False, tuple(f"v{i}" for _, i, _ in members), signal=signal,
        tokens=sum(n for *_, n in members), members=tuple(m for m, _, _ in members),
        member_tokens=tuple(n for *_, n in members),
    )


def _window(keep: int = 2, batch: int = 100, policy: StaleGroups = StaleGroups.WITHHOLD) -> WindowReplay:
    return WindowReplay(WindowSettings(keep_versions=keep, batch_groups=batch, stale_groups=policy), _registry().index)


def test_a_stale_group_keeps_its_fresh_members_and_withholds_the_others() -> None:
    w = _window(keep=2)
    w.feed(_group("new", ("n", 5, 1)))  # window: v4..v5
    res = w.feed(_group("g", ("a", 3, 10), ("b", 4, 20), ("c", 5, 30)))
    [d] = res.decisions
    assert d.decision is Decision.KEPT and d.withheld == ("a",)
    assert w.state.pending[-1].withheld == ("a",)
    assert w.state.tokens == TokenTally(generated=61, withheld=10)


def test_drop_policy_still_drops_the_whole_group() -> None:
    w = _window(keep=2, policy=StaleGroups.DROP)
    w.feed(_group("new", ("n", 5, 1)))
    [d] = w.feed(_group("g", ("a", 3, 10), ("b", 4, 20))).decisions
    assert d.decision is Decision.DROPPED_STALE and d.withheld == ()
    assert w.state.tokens == TokenTally(generated=31, window=30)


def test_a_group_with_every_member_outside_is_dropped_whole() -> None:
    w = _window(keep=1)
    w.feed(_group("new", ("n", 5, 1)))
    [d] = w.feed(_group("g", ("a", 3, 10), ("b", 4, 20))).decisions
    assert d.decision is Decision.DROPPED_STALE
    assert w.state.tokens.window == 30 and w.state.tokens.withheld == 0


def test_a_group_without_member_ids_can_only_be_judged_whole() -> None:
    w = _window(keep=2)
    w.feed(_group("new", ("n", 5, 1)))
    anonymous = WindowGroup("g", "p", 0, False, ("v3", "v5"), tokens=9)
    [d] = w.feed(anonymous).decisions
    assert d.decision is Decision.DROPPED_STALE


def test_an_advance_withholds_pending_members_then_drops_the_group_once_none_is_inside() -> None:
    w = _window(keep=2)
    w.feed(_group("g", ("a", 1, 10), ("b", 2, 20), ("c", 3, 30)))  # current v3: all inside (v2..v3)... a at v1
    assert w.state.pending[0].withheld == ("a",)
    assert w.state.tokens.withheld == 10
    res = w.feed(_group("h", ("x", 4, 5)))  # window v3..v4: b withheld too, no new decision for g
    assert [d.group_id for d in res.decisions] == ["h"]
    g = next(p for p in w.state.pending if p.group_id == "g")
    assert g.withheld == ("a", "b")
    assert w.state.tokens == TokenTally(generated=65, withheld=30)
    res = w.feed(_group("i", ("y", 5, 7)))  # window v4..v5: c leaves, g has no member inside: dropped
    drop = next(d for d in res.decisions if d.group_id == "g")
    assert drop.decision is Decision.DROPPED_RETROACTIVE and drop.tokens == 30, "a and b were counted when withheld"
    assert w.state.tokens == TokenTally(generated=72, window=30, withheld=30)


def test_staleness_comes_before_signal_and_withheld_members_count_only_when_kept() -> None:
    w = WindowReplay(
        WindowSettings(keep_versions=2, batch_groups=100, no_signal_groups=NoSignalGroups.DROP,
                       stale_groups=StaleGroups.WITHHOLD),
        _registry().index,
    )
    w.feed(_group("new", ("n", 5, 1)))
    [d] = w.feed(_group("flat", ("a", 3, 10), ("b", 5, 20), signal=False)).decisions
    assert d.decision is Decision.DROPPED_NO_SIGNAL
    assert w.state.tokens == TokenTally(generated=31, no_signal=30)


def test_the_batch_gap_counts_only_trained_members() -> None:
    w = _window(keep=2, batch=1)
    w.feed(_group("new", ("n", 5, 1)))
    res = w.feed(_group("g", ("a", 1, 10), ("b", 5, 20)))
    assert res.batch is not None
    assert [g.withheld for g in res.batch.groups] == [("a",)]
    assert res.batch.gap is not None and res.batch.gap.max == 0


def test_stale_members_and_group_validation() -> None:
    reg = _registry()
    g = _group("g", ("a", 1, 1), ("b", 4, 2))
    assert stale_members(g, 3, reg.index) == ("a",)
    assert stale_members(g, None, reg.index) == ()
    assert g.tokens_of(["a", "b", "zz"]) == 3
    with pytest.raises(ValueError, match="members"):
        WindowGroup("g", "p", 0, False, ("v1", "v2"), members=("a",))
    with pytest.raises(ValueError, match="token counts"):
        WindowGroup("g", "p", 0, False, ("v1",), members=("a",), member_tokens=(1, 2))
    with pytest.raises(ValueError, match="withhold"):
        WindowSettings(keep_versions=1, batch_groups=1, stale_groups="sometimes")  # type: ignore[arg-type]


def test_window_view_records_members_and_their_tokens() -> None:
    samples = [SegmentEnd("s0", 0, "v1", 3), SegmentEnd("s0", 1, "v2", 2), SegmentEnd("s1", 0, "v1", 4),
               SegmentEnd("s2", 0, None, 5)]
    g = window_group_from_samples("g", "p", 0, False, samples)
    assert g.members == ("s0", "s1") and g.versions == ("v2", "v1")
    assert g.member_tokens == (5, 4) and g.tokens == 14, "an unversioned trajectory's tokens count in the group"


members_strategy = st.lists(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), min_size=1, max_size=4),
    min_size=1,
    max_size=25,
)
"""Groups as lists of (version index, trainable tokens) per member."""


@given(members_strategy, st.integers(1, 4), st.integers(1, 3))
def test_withhold_trains_only_members_inside_the_window_and_accounts_for_every_token(
    raw: list[list[tuple[int, int]]], keep: int, batch_groups: int
) -> None:
    reg = _registry()
    w = WindowReplay(WindowSettings(keep_versions=keep, batch_groups=batch_groups, stale_groups=StaleGroups.WITHHOLD),
                     reg.index)
    trained = 0
    for i, members in enumerate(raw):
        group = _group(f"g{i}", *((f"g{i}m{j}", v, n) for j, (v, n) in enumerate(members)))
        res = w.feed(group)
        if res.batch is not None:
            cutoff = res.batch.window.cutoff_index
            for g in res.batch.groups:
                inside = [m for m, v in zip(g.members, g.versions, strict=True) if m not in g.withheld]
                assert inside, "a batched group has a member to train"
                for m, v in zip(g.members, g.versions, strict=True):
                    if cutoff is not None:
                        assert (reg.index(v) >= cutoff) == (m not in g.withheld)
                trained += g.tokens_of(inside)
    pending = sum(g.tokens_of(m for m in g.members if m not in g.withheld) for g in w.state.pending)
    tally = w.state.tokens
    assert tally.generated == sum(n for members in raw for _, n in members)
    assert tally.generated == tally.untrained + trained + pending
