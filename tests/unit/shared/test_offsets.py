"""The one offset bookkeeping of every consumer, as tables of event sequences, plus a property test."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.offsets import Offsets

P0, P1 = ("t", 0), ("t", 1)

Event = tuple[str, tuple[str, int] | None, int | None]
"""(kind, partition, offset): deliver / done / revoke / assign / commit (commit takes what to_commit says)."""


def run(events: list[Event]) -> tuple[Offsets, list[bool], list[dict[tuple[str, int], int]]]:
    """Play ``events``; returns the tracker, each deliver's answer, and each commit's positions."""
    offsets = Offsets()
    delivered: list[bool] = []
    commits: list[dict[tuple[str, int], int]] = []
    for kind, tp, offset in events:
        if kind == "deliver":
            assert tp is not None and offset is not None
            delivered.append(offsets.deliver(tp, offset))
        elif kind == "done":
            assert tp is not None and offset is not None
            offsets.done(tp, offset)
        elif kind == "revoke":
            offsets.revoke([tp] if tp else [P0, P1])
        elif kind == "assign":
            offsets.assign([tp] if tp else [P0, P1])
        elif kind == "commit":
            positions = offsets.to_commit()
            commits.append(positions)
            offsets.committed(positions)
        else:
            raise AssertionError(kind)
    return offsets, delivered, commits


def d(offset: int, tp: tuple[str, int] = P0) -> Event:
    return ("deliver", tp, offset)


def done(offset: int, tp: tuple[str, int] = P0) -> Event:
    return ("done", tp, offset)


COMMIT: Event = ("commit", None, None)
REVOKE: Event = ("revoke", None, None)
ASSIGN: Event = ("assign", None, None)


@pytest.mark.parametrize(
    ("events", "delivered", "commits"),
    [
        pytest.param([d(0), d(1), done(0), done(1), COMMIT], [True, True], [{P0: 2}], id="in-order"),
        pytest.param([d(0), d(1), done(1), COMMIT, done(0), COMMIT], [True, True], [{P0: 0}, {P0: 2}],
                     id="out-of-order: an open record holds the partition"),
        pytest.param([d(0), COMMIT], [True], [{P0: 0}], id="nothing done: commit the first open offset"),
        pytest.param([d(5), d(7), d(9), done(7), done(5), COMMIT, done(9), COMMIT], [True] * 3,
                     [{P0: 9}, {P0: 10}], id="gaps between offsets are fine"),
        pytest.param([d(0), done(0), done(0), COMMIT], [True], [{P0: 1}], id="done twice is a no-op"),
        pytest.param([d(0), d(0), COMMIT, done(0), COMMIT], [True, False], [{P0: 0}, {P0: 1}],
                     id="re-delivery in one assignment is not new work"),
        pytest.param([d(0), done(0), COMMIT, d(0), COMMIT], [True, False], [{P0: 1}, {}],
                     id="re-delivery below the committed position is ignored too"),
        pytest.param([done(3), COMMIT], [], [{}], id="done for a record never delivered changes nothing"),
        pytest.param([d(0), d(1), done(0), COMMIT, done(0), COMMIT], [True, True], [{P0: 1}, {}],
                     id="only advances are reported"),
        pytest.param([d(0), d(0, P1), done(0, P1), COMMIT], [True, True], [{P0: 0, P1: 1}],
                     id="partitions are independent"),
        # A make-test failure once: offset 5 queued, the group rebalances, 5 is delivered again.
        pytest.param([ASSIGN, d(5), REVOKE, ASSIGN, d(5), COMMIT, done(5), COMMIT], [True, True], [{P0: 5}, {P0: 6}],
                     id="revoke then assign: state rebuilt, the re-delivery is the work"),
        pytest.param([ASSIGN, d(5), REVOKE, done(5), COMMIT], [True], [{}],
                     id="done after a revoke: no commit for a partition not held"),
        pytest.param([ASSIGN, d(5), REVOKE, ASSIGN, done(5), COMMIT, d(5), COMMIT], [True, True], [{}, {P0: 5}],
                     id="a stale done does not close a record of the next assignment it never saw"),
        pytest.param([ASSIGN, d(4), d(5), done(4), REVOKE, ASSIGN, d(5), done(5), COMMIT], [True, True, True],
                     [{P0: 6}], id="the next assignment starts where the last commit left it"),
        pytest.param([d(0, P0), d(0, P1), ("revoke", P1, None), done(0, P0), done(0, P1), COMMIT], [True, True],
                     [{P0: 1}], id="revoking one partition keeps the other"),
    ],
)
def test_offset_events(events: list[Event], delivered: list[bool], commits: list[dict[tuple[str, int], int]]) -> None:
    _, got_delivered, got_commits = run(events)
    assert got_delivered == delivered
    assert got_commits == commits


def test_done_says_whether_it_closed_an_open_record() -> None:
    offsets, _, _ = run([d(0), d(1)])
    assert offsets.done(P0, 0) and not offsets.done(P0, 0)  # the second time is a no-op
    assert not offsets.done(P0, 7) and not offsets.done(P1, 0)  # never delivered, never assigned
    assert offsets.is_open(P0, 1) and not offsets.is_open(P0, 0)


def test_committed_forgets_what_it_passed() -> None:
    offsets, _, _ = run([d(i) for i in range(1000)] + [done(i) for i in range(1000)] + [COMMIT])
    part = offsets._parts[P0]
    assert part.delivered == set() and part.committed == 1000


@given(
    st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=30, unique=True),
    st.data(),
)
def test_commit_never_passes_an_open_record(deliveries: list[int], data: st.DataObject) -> None:
    """Any done order, with commits in between: the committed position is never above an open offset,
    and once everything is done it is one past the highest offset."""
    offsets = Offsets()
    ordered = sorted(deliveries)  # Kafka delivers a partition in offset order within an assignment
    for o in ordered:
        assert offsets.deliver(P0, o)
    to_close = data.draw(st.permutations(ordered))
    committed = -1
    for o in to_close:
        offsets.done(P0, o)
        positions = offsets.to_commit()
        if P0 in positions:
            assert positions[P0] > committed
            committed = positions[P0]
            offsets.committed(positions)
        assert all(committed <= x for x in ordered if offsets.is_open(P0, x))
    assert committed == ordered[-1] + 1


def test_last_is_the_highest_offset_delivered_in_this_assignment() -> None:
    offsets = Offsets()
    offsets.assign([P0])
    assert offsets.last(P0) is None
    offsets.deliver(P0, 7)
    offsets.deliver(P0, 9)
    offsets.deliver(P0, 8)  # a re-read below the highest does not lower it
    assert offsets.last(P0) == 9
    offsets.revoke([P0])
    assert offsets.last(P0) is None
    offsets.assign([P0])
    assert offsets.last(P0) is None, "a new assignment starts with nothing delivered"
