"""The runner's pure scheduling rules: retry priority, the in-flight bound, sync waves, offsets."""

from __future__ import annotations

import itertools

import pytest

from services.rollout.scheduler import AVAILABILITY_ERRORS, BackendGate, OffsetTracker, RetrySource, Scheduler, Work
from services.rollout.task import NumberGuessTask


def _sched(**kw: object) -> Scheduler:
    return Scheduler(NumberGuessTask().prompts(0), **kw)  # type: ignore[arg-type]


def _retry(prompt_id: str, attempt: int = 1, offset: int = 0) -> Work:
    return Work(prompt_id, attempt, {"secret": 3}, RetrySource("rollout.retries", 0, offset))


def test_retries_go_before_new_prompts_in_arrival_order() -> None:
    s = _sched(max_in_flight=10)
    first = s.take()
    assert first is not None and first.kind == "new" and first.attempt == 0
    s.add_retry(_retry("p-a", 1))
    s.add_retry(_retry("p-b", 2))
    taken = [s.take() for _ in range(3)]
    assert [(w.prompt_id, w.attempt, w.kind) for w in taken if w] [:2] == [("p-a", 1, "retry"), ("p-b", 2, "retry")]
    assert taken[2] is not None and taken[2].kind == "new"


def test_duplicate_retry_is_dispatched_once() -> None:
    s = _sched(max_in_flight=10)
    assert s.add_retry(_retry("p", 1, offset=3))
    assert not s.add_retry(_retry("p", 1, offset=9))
    assert s.add_retry(_retry("p", 2, offset=10))
    assert s.pending_retries == 2


@pytest.mark.parametrize("bound", [1, 3, 8])
def test_in_flight_bound(bound: int) -> None:
    s = _sched(max_in_flight=bound)
    assert all(s.take() is not None for _ in range(bound))
    assert s.take() is None
    s.add_retry(_retry("p"))
    assert s.take() is None  # retries respect the bound too
    s.on_group_done()
    w = s.take()
    assert w is not None and w.prompt_id == "p"
    assert s.in_flight == bound


def test_max_groups_counts_retries_and_finishes() -> None:
    s = _sched(max_in_flight=10, max_groups=3)
    s.add_retry(_retry("p"))
    taken = [s.take() for _ in range(5)]
    assert [w is not None for w in taken] == [True, True, True, False, False]
    assert s.exhausted and not s.finished
    for _ in range(3):
        s.on_group_done()
    assert s.finished


def test_give_back_keeps_work_first_in_line() -> None:
    s = _sched(max_in_flight=2)
    w = s.take()
    assert w is not None
    s.give_back(w)
    assert s.in_flight == 0 and s.dispatched == 0
    again = s.take()
    assert again == w
    r = _retry("p")
    s.add_retry(r)
    got = s.take()
    assert got == r
    s.give_back(got)
    s.add_retry(_retry("q"))
    s.on_group_done()
    assert s.take() == r


def test_on_group_done_without_a_group_is_a_bug() -> None:
    with pytest.raises(RuntimeError):
        _sched(max_in_flight=1).on_group_done()


def test_sync_mode_waits_for_groups_and_a_newer_weight_version() -> None:
    s = _sched(max_in_flight=10, mode="sync", groups_per_step=2, weights_seq=4)
    wave0 = [s.take(), s.take()]
    assert all(w is not None for w in wave0)
    assert s.take() is None  # wave full
    s.on_group_done()
    assert s.take() is None and not s.waiting_for_weights  # one group still running
    s.on_group_done()
    assert s.waiting_for_weights
    s.on_weights_applied(4)  # the same version again (replayed record) opens nothing
    assert s.take() is None
    s.on_weights_applied(5)
    assert not s.waiting_for_weights
    nxt = s.take()
    assert nxt is not None and s.wave == 1 and s.wave_new == 1 and s.wave_baseline == 5


def test_sync_mode_weights_during_the_wave_do_not_count_twice() -> None:
    s = _sched(max_in_flight=10, mode="sync", groups_per_step=1)
    assert s.take() is not None
    s.on_weights_applied(0)  # trained on this wave's data, arrived before the group was marked done
    s.on_group_done()
    assert s.take() is not None  # the update counts for this wave
    s.on_group_done()
    assert s.waiting_for_weights  # and not again for the next one


def test_sync_mode_retries_are_not_gated() -> None:
    s = _sched(max_in_flight=10, mode="sync", groups_per_step=1)
    assert s.take() is not None
    s.on_group_done()
    assert s.waiting_for_weights
    s.add_retry(_retry("p"))
    w = s.take()
    assert w is not None and w.kind == "retry"
    s.on_group_done()
    assert s.take() is None


def test_sync_mode_forced_wave_after_timeout() -> None:
    s = _sched(max_in_flight=10, mode="sync", groups_per_step=1)
    assert s.take() is not None
    s.on_group_done()
    assert s.take() is None
    s.open_next_wave()
    assert s.take() is not None and s.wave == 1


def test_async_mode_ignores_weights() -> None:
    s = _sched(max_in_flight=3)
    assert [s.take() is not None for _ in range(4)] == [True, True, True, False]
    assert not s.waiting_for_weights


@pytest.mark.parametrize(
    ("seen", "handled", "commits"),
    [
        ([0, 1, 2], [0, 1, 2], [1, 2, 3]),
        ([0, 1, 2], [2, 1, 0], [None, None, 3]),
        ([0, 1, 2], [1, 0, 2], [None, 2, 3]),
        ([5, 7, 9], [7, 5, 9], [None, 8, 10]),  # gaps (skipped poison records) are fine
    ],
)
def test_offset_tracker(seen: list[int], handled: list[int], commits: list[int | None]) -> None:
    t = OffsetTracker()
    for o in seen:
        t.seen("r", 0, o)
    assert [t.handled("r", 0, o) for o in handled] == commits


def test_offset_tracker_partitions_are_independent_and_double_handling_is_a_bug() -> None:
    t = OffsetTracker()
    for p, o in itertools.product([0, 1], [0, 1]):
        t.seen("r", p, o)
    assert t.handled("r", 1, 0) == 1
    assert t.handled("r", 0, 1) is None
    assert t.handled("r", 0, 0) == 2
    with pytest.raises(KeyError):
        t.handled("r", 0, 0)


def test_backend_gate_closes_on_an_outage_probes_with_doubling_delays_and_opens_on_success() -> None:
    gate = BackendGate(first_s=0.5, cap_s=2.0)
    assert gate.may_dispatch(in_flight=8)
    gate.on_group(backend_down=True, probe=False)  # first group of the outage
    assert gate.closed and gate.delay_s == 0.5
    assert not gate.may_dispatch(in_flight=7)  # the other in-flight groups end first
    for _ in range(7):
        gate.on_group(backend_down=True, probe=False)  # they fail too: no escalation for them
    assert gate.delay_s == 0.5
    assert gate.may_dispatch(in_flight=0)  # one probe
    assert not gate.may_dispatch(in_flight=1)
    delays = []
    for _ in range(4):
        gate.on_group(backend_down=True, probe=True)
        delays.append(gate.delay_s)
    assert delays == [1.0, 2.0, 2.0, 2.0]
    gate.on_group(backend_down=False, probe=True)
    assert not gate.closed and gate.delay_s == 0.0 and gate.may_dispatch(in_flight=8)


def test_availability_errors_are_the_backends_not_the_prompts() -> None:
    assert {"unreachable", "engine_unavailable", "kafka_unavailable", "timeout"} == AVAILABILITY_ERRORS
    assert not {"partial_rollout_staleness_exceeded", "context_overflow", "session_busy"} & AVAILABILITY_ERRORS
