"""The proxy's pause controller against an in-memory engine: when a pause counts as quiesced (a weight
update must find no request still running on the old weights), aborts re-sent and sent to each engine
in one call, admission held while paused, and pause ids with leases that run out, so that a broadcaster
that died never leaves the proxy paused."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import pytest

from services.proxy.engine_client import AbortOutcome
from services.proxy.generation import ActiveRequest, PauseController, generate_preemptible
from shared.errors import GenerationPreempted
from tests.support.generation_engine import PROMPT, FakeEngine, Harness, harness, request, run


def test_pause_quiesces_on_the_engines_word_before_the_answers_are_processed() -> None:
    """The engine confirms one request aborted and one already finished: the pause quiesces while
    neither answer is recorded; both are recorded afterwards, the preempted one continues at resume."""

    async def body() -> None:
        h = harness()
        h.engine.confirms = True
        h.recording.clear()
        running = asyncio.create_task(h.generate(request(budget=10)))
        first = await h.engine.wait_calls(1)
        ended = asyncio.create_task(h.generate(request(budget=10), prefix="other"))
        second = await h.engine.wait_calls(2)
        h.engine.answer(second, [4, 0], "stop")  # ended on the engine, its answer not processed yet
        h.engine.partial[first.rid] = [7, 8]
        result = await h.controller.pause("weight_update", 2.0, h.engine.abort_many)
        assert result.quiesced and result.active == 0
        assert result.preempted == [first.rid] and sorted(result.aborts_sent) == sorted([first.rid, second.rid])
        assert len(h.controller.active()) == 2 and h.chunks == []  # quiesced, still being recorded
        h.recording.set()
        assert (await ended).output_ids == [4, 0]
        while h.controller.held == 0:
            await asyncio.sleep(0)
        assert h.controller.resume() == "resumed"
        third = await h.engine.wait_calls(3)
        assert third.input_ids == [*PROMPT, 7, 8] and third.max_new == 8
        h.engine.answer(third, [9, 0], "stop")
        assert (await running).output_ids == [7, 8, 9, 0]
        assert sorted(c.chunk_index for c in h.chunks) == [0, 0, 1]

    run(body)


def test_unconfirmed_abort_waits_for_the_answer_to_be_processed() -> None:
    """SGLang only accepts the abort: quiescence then needs the release (the answer recorded)."""

    async def body() -> None:
        h = harness()
        h.recording.clear()
        task = asyncio.create_task(h.generate(request(partial=False)))
        await h.engine.wait_calls(1)
        result = await h.controller.pause("weight_update", 0.05, h.engine.abort_many)
        assert not result.quiesced and result.active == 1 and result.preempted == []
        h.recording.set()
        with pytest.raises(GenerationPreempted):
            await task
        again = await h.controller.pause("weight_update", 0.05, h.engine.abort_many)
        assert again.quiesced and again.active == 0

    run(body)


def test_pause_timeout_reports_not_quiesced() -> None:
    async def body() -> None:
        h = harness()
        h.engine.abort_finds = ["unknown"] * 1000  # the engine never finds the request
        task = asyncio.create_task(h.generate(request()))
        call = await h.engine.wait_calls(1)
        result = await h.controller.pause("weight_update", 0.2, h.engine.abort_many, abort_retry_s=0.01)
        assert result.quiesced is False and result.active == 1 and result.preempted == []
        assert len(h.engine.aborts) > 1  # the abort was re-sent
        again = await h.controller.pause("weight_update", 0.05, h.engine.abort_many, abort_retry_s=0.01)
        assert again.status == "already_paused" and again.quiesced is False
        h.engine.answer(call, [1], "stop")
        await task
        third = await h.controller.pause("weight_update", 0.05, h.engine.abort_many)
        assert third.quiesced and third.active == 0

    run(body)


def test_abort_that_overtook_generate_is_resent() -> None:
    async def body() -> None:
        h = harness()
        h.engine.abort_finds = ["unknown", "unknown", "accepted"]
        task = asyncio.create_task(h.generate(request()))
        await h.engine.wait_calls(1)
        result = await h.controller.pause("weight_update", 2.0, h.engine.abort_many, abort_retry_s=0.001)
        assert result.quiesced and result.preempted == ["rid-0"] and len(h.engine.aborts) == 3
        h.controller.resume()
        call = await h.engine.wait_calls(2)
        h.engine.answer(call, [1], "stop")
        await task

    run(body)


def test_admission_waits_while_paused() -> None:
    async def body() -> None:
        h = harness()
        result = await h.controller.pause("weight_update", 1.0, h.engine.abort_many)
        assert result.quiesced and result.status == "paused"
        task = asyncio.create_task(h.generate(request()))
        for _ in range(10):
            await asyncio.sleep(0)
        assert h.engine.calls == []
        h.controller.resume()
        h.engine.answer(await h.engine.wait_calls(1), [1], "stop")
        await task
        assert h.controller.resume() == "already_running"

    run(body)


# Pause ids and leases: (call, pause id) in order -> the controller's answers. "pause" starts or takes
# over a pause (lease 10 s), "renew"/"resume" name a pause id ("-" = resume without an id).
@pytest.mark.parametrize(
    ("calls", "answers", "paused_after"),
    [
        ([("pause", "a"), ("renew", "a"), ("resume", "a")], ["paused", True, "resumed"], False),
        ([("pause", "a"), ("resume", "b")], ["paused", "stale"], True),  # a stale resume changes nothing
        ([("pause", "a"), ("renew", "b")], ["paused", False], True),
        ([("pause", "a"), ("pause", "b"), ("resume", "a"), ("resume", "b")],
         ["paused", "already_paused", "stale", "resumed"], False),  # a newer pause takes over
        ([("pause", "a"), ("resume", "-")], ["paused", "resumed"], False),  # an operator's resume
        ([("pause", "a"), ("resume", "a"), ("renew", "a"), ("resume", "a")],
         ["paused", "resumed", False, "already_running"], False),  # late calls of an ended pause
    ],
)
def test_pause_ids(calls: list[tuple[str, str]], answers: list[object], paused_after: bool) -> None:
    async def body() -> None:
        h = harness()
        got: list[object] = []
        for call, pause_id in calls:
            if call == "pause":
                paused = await h.controller.pause("w", 1.0, h.engine.abort_many, pause_id=pause_id, lease_s=10)
                got.append(paused.status)
            elif call == "renew":
                got.append(h.controller.renew(pause_id, 10))
            else:
                got.append(h.controller.resume(None if pause_id == "-" else pause_id))
        assert got == answers
        assert h.controller.paused is paused_after

    run(body)


class Clock:
    """A clock the test moves by hand."""

    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pause_lease_runs_out_unless_renewed() -> None:
    async def body() -> None:
        clock = Clock()
        h = Harness(FakeEngine(), PauseController(clock=clock))
        result = await h.controller.pause("w", 1.0, h.engine.abort_many, pause_id="p", lease_s=1.0)
        assert result.pause_id == "p" and result.lease_s == 1.0
        assert h.controller.lease_left_s() == 1.0 and not h.controller.expired()
        clock.now += 0.6
        assert h.controller.renew("p", 1.0)
        clock.now += 0.6
        assert h.controller.lease_left_s() == pytest.approx(0.4)
        assert not h.controller.expired()  # renewed: 1.2 s after the pause, inside the new lease
        clock.now += 0.4
        assert h.controller.expired() and h.controller.paused  # exactly at the lease's end; the proxy's watch resumes
        assert h.controller.resume("p") == "resumed"
        assert h.controller.lease_left_s() is None and not h.controller.expired()

    run(body)


def test_pause_lease_starts_when_the_wait_for_quiescence_ends() -> None:
    async def body() -> None:
        clock = Clock()
        h = Harness(FakeEngine(), PauseController(clock=clock))
        task = asyncio.create_task(h.generate(request()))
        await h.engine.wait_calls(1)
        h.engine.abort_finds = ["unknown"] * 1000  # the aborts find nothing: the pause waits for the release
        pausing = asyncio.create_task(h.controller.pause("w", 5.0, h.engine.abort_many, pause_id="p", lease_s=1.0))
        while not h.engine.aborts:
            await asyncio.sleep(0)
        clock.now += 30.0  # a long wait counts against no lease
        assert h.controller.lease_left_s() is None and not h.controller.expired()
        h.engine.answer(h.engine.calls[0], [7], "stop")
        result = await pausing
        assert result.quiesced and h.controller.lease_left_s() == 1.0
        h.controller.resume("p")
        await task

    run(body)


def test_admission_closed_time_runs_from_the_first_pause_to_the_resume() -> None:
    async def body() -> None:
        clock = Clock()
        h = Harness(FakeEngine(), PauseController(clock=clock))
        assert h.controller.closed_s() is None
        await h.controller.pause("w", 1.0, h.engine.abort_many, pause_id="a")
        clock.now += 0.05
        assert h.controller.closed_s() == pytest.approx(0.05)
        await h.controller.pause("w", 1.0, h.engine.abort_many, pause_id="b")  # a takeover keeps admission closed
        clock.now += 0.1
        assert h.controller.closed_s() == pytest.approx(0.15)
        h.controller.resume("b")
        assert h.controller.closed_s() is None

    run(body)


def test_pause_aborts_each_engines_requests_in_one_call() -> None:
    """Three generations on one engine and one on another: one abort call per engine, carrying
    every rid in flight there, and the pause quiesces on those two answers."""

    async def body() -> None:
        h = harness()
        other = FakeEngine(url="fake://other", confirms=True)
        h.engine.confirms = True
        tasks = [asyncio.create_task(h.generate(request(), prefix=f"a{i}")) for i in range(3)]
        await h.engine.wait_calls(3)
        rids = (f"b-{i}" for i in itertools.count())
        on_other = asyncio.create_task(generate_preemptible(
            request(), engine=other, controller=h.controller, new_rid=lambda: next(rids),
            before_chunk=lambda _: None, on_chunk=lambda c: asyncio.sleep(0),
        ))
        await other.wait_calls(1)
        engines = {e.url: e for e in (h.engine, other)}

        async def abort(requests: Sequence[ActiveRequest]) -> dict[str, AbortOutcome]:
            return await engines[requests[0].engine].abort_many(requests)

        result = await h.controller.pause("weight_update", 2.0, abort)
        assert result.quiesced and sorted(result.preempted) == ["a0-0", "a1-0", "a2-0", "b-0"]
        assert [sorted(c) for c in h.engine.bulk_calls] == [["a0-0", "a1-0", "a2-0"]]
        assert other.bulk_calls == [["b-0"]]
        h.controller.resume()
        for i in range(3, 6):
            h.engine.answer(await h.engine.wait_calls(i + 1), [1], "stop")
        other.answer(await other.wait_calls(2), [1], "stop")
        await asyncio.gather(*tasks, on_other)

    run(body)


def test_only_the_rids_an_engine_did_not_know_are_sent_again() -> None:
    """An abort that overtook one /generate: the next call carries that rid alone."""

    async def body() -> None:
        h = harness()
        h.engine.abort_finds = ["aborted", "unknown", "aborted"]  # in the order the rids are asked about
        tasks = [asyncio.create_task(h.generate(request(), prefix=f"r{i}")) for i in range(2)]
        await h.engine.wait_calls(2)
        result = await h.controller.pause("weight_update", 2.0, h.engine.abort_many, abort_retry_s=0.001)
        assert result.quiesced and sorted(result.preempted) == ["r0-0", "r1-0"]
        assert h.engine.bulk_calls == [["r0-0", "r1-0"], ["r1-0"]]
        h.controller.resume()
        for i in range(2, 4):
            h.engine.answer(await h.engine.wait_calls(i + 1), [1], "stop")
        await asyncio.gather(*tasks)

    run(body)
