"""The runner's pure scheduling rules: retry priority, duplicates and revokes, the in-flight bound, sync waves."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.rollout.scheduler import (
    BackendGate,
    PromptStream,
    RetrySource,
    Scheduler,
    Work,
    retry_work,
)
from services.rollout.task import NumberGuessTask


def _sched(**kw: object) -> Scheduler:
    return Scheduler(NumberGuessTask().prompts(0), **kw)  # type: ignore[arg-type]


def _src(offset: int, partition: int = 0) -> RetrySource:
    return RetrySource("rollout.retries", partition, offset)


def _retry(prompt_id: str, attempt: int = 1, offset: int = 0, partition: int = 0) -> Work:
    return retry_work(prompt_id, attempt, {"secret": 3}, _src(offset, partition))


def test_retries_go_before_new_prompts_in_arrival_order() -> None:
    s = _sched(max_in_flight=10)
    first = s.take()
    assert first is not None and first.kind == "new" and first.attempt == 0
    s.add_retry(_retry("p-a", 1))
    s.add_retry(_retry("p-b", 2))
    taken = [s.take() for _ in range(3)]
    assert [(w.prompt_id, w.attempt, w.kind) for w in taken if w] [:2] == [("p-a", 1, "retry"), ("p-b", 2, "retry")]
    assert taken[2] is not None and taken[2].kind == "new"


def test_duplicate_retry_is_dispatched_once_and_done_with_its_original() -> None:
    s = _sched(max_in_flight=10)
    assert s.add_retry(_retry("p", 1, offset=3)) == "queued"
    assert s.add_retry(_retry("p", 1, offset=9)) == "attached"  # republished: rides on the queued work
    assert s.add_retry(_retry("p", 2, offset=10)) == "queued"
    assert s.pending_retries == 2
    work = s.take()
    assert work is not None and work.key == ("p", 1, 0)
    assert s.add_retry(_retry("p", 1, offset=11)) == "attached"  # while its dispatch is in progress
    assert s.confirm(work) == [_src(3), _src(9), _src(11)]  # every record that asked for it is done now
    assert s.add_retry(_retry("p", 1, offset=12)) == "dispatched"  # later copies: done at once by the caller
    assert s.pending_retries == 1


# Event tables for the retry records of one runner: (event, argument) -> outcome. A record is only
# ever marked done by ``confirm`` (its group's GroupDispatched is in Kafka) or by an add_retry answer
# of "dispatched"; never on behalf of work that has not happened (a make-test failure once).
@pytest.mark.parametrize(
    ("events", "expected_done", "expected_queue"),
    [
        # the runner's crash: offset 5 queued, the dispatch fails (gate closed), the partition is revoked
        # and re-assigned, offset 5 is delivered again. Old state is dropped, the new delivery queues it
        # once, and only its dispatch makes offset 5 done.
        ([("add", 5), ("take", None), ("give_back", None), ("revoke", 0), ("add", 5), ("take", None),
          ("confirm", None)], [5], []),
        # revoked while queued, the partition goes to another runner: nothing is dispatched, nothing done here
        ([("add", 5), ("add", 6), ("revoke", 0)], [], []),
        # revoked while its dispatch is in progress: the dispatch is real and goes through
        ([("add", 5), ("take", None), ("revoke", 0), ("confirm", None)], [], []),
        # revoked while in progress and the dispatch fails: dropped (the new owner dispatches it)
        ([("add", 5), ("take", None), ("revoke", 0), ("give_back", None)], [], []),
        # a duplicate publish on another partition survives the revoke of the original's partition
        ([("add", 5), ("add_p1", 7), ("revoke", 0), ("take", None), ("confirm", None)], [(1, 7)], []),
        # a revoke of another partition leaves the queue alone
        ([("add", 5), ("revoke", 1)], [], [5]),
    ],
)
def test_retry_records_are_done_only_with_their_dispatch(
    events: list[tuple[str, int | None]], expected_done: list[int | tuple[int, int]], expected_queue: list[int]
) -> None:
    s = _sched(max_in_flight=10)
    done: list[RetrySource] = []
    taken: Work | None = None
    for event, arg in events:
        if event == "add":
            assert arg is not None
            if s.add_retry(_retry("p", 1, offset=arg)) == "dispatched":
                done.append(_src(arg))
        elif event == "add_p1":
            assert arg is not None
            s.add_retry(_retry("p", 1, offset=arg, partition=1))
        elif event == "take":
            taken = s.take()
            assert taken is not None and taken.kind == "retry"
        elif event == "give_back":
            assert taken is not None
            s.give_back(taken)
        elif event == "confirm":
            assert taken is not None
            done.extend(s.confirm(taken))
        else:
            s.revoke({("rollout.retries", arg if arg is not None else 0)})
    assert [d.offset if d.partition == 0 else (d.partition, d.offset) for d in done] == expected_done
    queued = []
    while (w := s.take()) is not None and w.kind == "retry":
        queued.extend(src.offset for src in w.sources)
    assert queued == expected_queue


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


def test_sync_mode_a_batch_the_trainer_skipped_opens_the_next_wave() -> None:
    """The trainer consumed the wave's batch without an update (no gradient): no version will come."""
    s = _sched(max_in_flight=10, mode="sync", groups_per_step=1, weights_seq=3)
    s.on_batch_skipped(6)  # history: a skip before this wave opened
    assert s.take() is not None
    s.on_group_done()
    assert s.waiting_for_weights
    s.on_batch_skipped(6)  # the same record again opens nothing
    assert s.take() is None
    s.on_batch_skipped(7)
    assert not s.waiting_for_weights
    assert s.take() is not None and s.wave == 1
    s.on_group_done()
    assert s.waiting_for_weights  # the skip counted once; the next wave waits again
    s.on_weights_applied(4)
    assert s.take() is not None and s.wave == 2


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


def test_sync_mode_tops_its_wave_up_for_each_group_dropped_without_signal() -> None:
    s = _sched(max_in_flight=10, mode="sync", groups_per_step=2, weights_seq=0)
    s.on_no_signal_drops(500)  # the first report is a baseline: earlier runs' drops
    assert [s.take() is not None for _ in range(3)] == [True, True, False]
    s.on_group_done()
    s.on_no_signal_drops(501)  # that group had no signal: the batch needs one more
    assert s.wave_target == 3 and s.take() is not None and s.take() is None
    s.on_no_signal_drops(501)  # the same count again lets nothing more in
    assert s.take() is None
    s.on_group_done()
    s.on_group_done()
    assert s.waiting_for_weights
    s.on_weights_applied(1)
    assert s.take() is not None and s.wave == 1 and s.wave_target == 2  # a new wave starts from its own count


def test_sync_mode_without_drop_reports_keeps_its_wave() -> None:
    s = _sched(max_in_flight=10, mode="sync", groups_per_step=2)
    assert [s.take() is not None for _ in range(3)] == [True, True, False] and s.wave_target == 2


@given(signal=st.lists(st.booleans(), min_size=60, max_size=60), per_step=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_sync_waves_fill_each_batch_with_signal_and_dispatch_none_too_many(
    signal: list[bool], per_step: int, seed: int
) -> None:
    """A simulated collector: each ended group is decided (kept when it carries signal, else dropped and
    counted), a batch forms when ``per_step`` kept groups are pending, its update opens the next wave. The
    runner reports the drop count after each decision (or later: ``lag`` decisions late) and takes what
    the scheduler gives. Every batch holds exactly ``per_step`` groups and nothing of the wave is left in
    flight or undecided when it forms."""
    rng = random.Random(seed)
    s = _sched(max_in_flight=100, mode="sync", groups_per_step=per_step, weights_seq=0)
    s.on_no_signal_drops(0)
    outcomes = iter(signal)
    running: list[bool] = []
    unreported: list[int] = []
    kept = drops = version = batches = 0  # kept: pending in the batch being formed; drops: cumulative
    for _ in range(400):
        while s.take() is not None:
            running.append(next(outcomes, True))
        assert running or unreported, "the wave is short of its batch and nothing may start: stuck"
        if running:  # one group ends, in any order, and is decided
            carries = running.pop(rng.randrange(len(running)))
            s.on_group_done()
            if carries:
                kept += 1
            else:
                drops += 1
            unreported.append(drops)
        if unreported and (rng.random() < 0.5 or not running):  # the runner reads the window, maybe late
            s.on_no_signal_drops(unreported[-1])
            unreported.clear()
        if kept == per_step:
            assert not running and s.in_flight == 0, "a group of the wave outlived its batch"
            kept, batches, version = 0, batches + 1, version + 1
            s.on_weights_applied(version)
    assert batches > 0
    assert s.dispatched == batches * per_step + kept + drops + len(running), "every dispatch accounted for"


def test_async_mode_ignores_weights() -> None:
    s = _sched(max_in_flight=3)
    assert [s.take() is not None for _ in range(4)] == [True, True, True, False]
    assert not s.waiting_for_weights


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


def test_a_claimed_stream_gives_only_claimed_prompts_in_stream_order() -> None:
    ids = [p.prompt_id for p in itertools.islice(NumberGuessTask().prompts(0), 6)]
    stream = PromptStream(NumberGuessTask().prompts(0), claimed=True)
    s = Scheduler(stream, max_in_flight=10)
    assert not stream.available() and s.take() is None  # nothing claimed: nothing new may start
    stream.claim(0)
    stream.claim(3)  # indices 1 and 2 were claimed by another runner
    taken = [s.take(), s.take(), s.take()]
    assert [w.prompt_id if w else None for w in taken] == [ids[0], ids[3], None]
    with pytest.raises(ValueError, match="behind the stream"):
        stream.claim(2)
    s.add_retry(_retry("p-r"))
    retry = s.take()
    assert retry is not None and retry.kind == "retry"  # retries need no claim
