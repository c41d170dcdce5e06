"""The preemptible generation loop and the pause controller, against an in-memory engine."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from services.proxy.engine_client import AbortOutcome, EngineOutput, FinishReason, Sampling
from services.proxy.generation import (
    ActiveRequest,
    ChunkOutcome,
    Generation,
    GenerationRequest,
    PauseController,
    generate_preemptible,
)
from shared.errors import EngineError, GenerationPreempted, PartialRolloutStalenessExceeded

T = TypeVar("T")
PROMPT = (1, 2, 3)


def run(body: Callable[[], Awaitable[T]], timeout_s: float = 5.0) -> T:
    async def main() -> T:
        return await asyncio.wait_for(body(), timeout_s)

    return asyncio.run(main())


@dataclass
class Call:
    rid: str
    input_ids: list[int]
    max_new: int
    result: asyncio.Future[EngineOutput]


@dataclass
class FakeEngine:
    """Each generate call waits until the test answers it (``answer``) or an abort ends it."""

    url: str = "fake://engine"
    calls: list[Call] = field(default_factory=list)
    new_call: asyncio.Event = field(default_factory=asyncio.Event)
    partial: dict[str, list[int]] = field(default_factory=dict)
    """Tokens a request 'has' when aborted."""
    version: str = "v1"
    abort_finds: list[AbortOutcome] = field(default_factory=list)
    """Scripted answers of abort() (``accepted``: ends the call, as SGLang, without saying so);
    default ``accepted`` once exhausted, or with ``confirms`` what rein's engine answers."""
    confirms: bool = False
    """Answer as rein's engine: ``aborted`` for a call it ended now, ``finished`` for one already answered."""
    aborts: list[str] = field(default_factory=list)
    bulk_calls: list[list[str]] = field(default_factory=list)

    async def generate(
        self, rid: str, input_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids: Sequence[int]
    ) -> EngineOutput:
        call = Call(rid, list(input_ids), max_new_tokens, asyncio.get_running_loop().create_future())
        self.calls.append(call)
        self.new_call.set()
        return await call.result

    async def wait_calls(self, n: int) -> Call:
        while len(self.calls) < n:
            self.new_call.clear()
            await self.new_call.wait()
        return self.calls[n - 1]

    def answer(self, call: Call, ids: list[int], reason: FinishReason) -> None:
        if not call.result.done():
            call.result.set_result(out(call.rid, ids, reason, self.version))

    async def abort(self, request: ActiveRequest) -> AbortOutcome:
        self.aborts.append(request.rid)
        if self.abort_finds:
            outcome = self.abort_finds.pop(0)
        elif self.confirms:
            known = [c for c in self.calls if c.rid == request.rid]
            outcome = "unknown" if not known else "finished" if known[0].result.done() else "aborted"
        else:
            outcome = "accepted"
        if outcome in ("accepted", "aborted"):
            for call in self.calls:
                if call.rid == request.rid:
                    self.answer(call, self.partial.get(call.rid, []), "abort")
        return outcome


    async def abort_many(self, requests: Sequence[ActiveRequest]) -> dict[str, AbortOutcome]:
        """One call for many rids, as rein's ``/abort_requests`` (each rid answered as by ``abort``)."""
        self.bulk_calls.append([r.rid for r in requests])
        return {r.rid: await self.abort(r) for r in requests}


def out(rid: str, ids: list[int], reason: FinishReason, version: str) -> EngineOutput:
    return EngineOutput(rid, ids, [-0.5] * len(ids), version, [version] * len(ids), reason)


def request(budget: int = 10, partial: bool = True, window: int = 64) -> GenerationRequest:
    return GenerationRequest(
        session_id="s", prompt_ids=PROMPT, context_ids=PROMPT, budget=budget, window=window,
        sampling=Sampling(temperature=1.0), partial_rollout=partial, max_chunks=8,
    )


@dataclass
class Harness:
    engine: FakeEngine
    controller: PauseController
    chunks: list[ChunkOutcome] = field(default_factory=list)
    checks: list[int] = field(default_factory=list)
    recording: asyncio.Event = field(default_factory=asyncio.Event)
    """on_chunk waits for it: a test clears it to keep answers unprocessed (the proxy's backlog)."""

    def __post_init__(self) -> None:
        self.recording.set()

    async def generate(
        self, req: GenerationRequest, reject_before: int | None = None, prefix: str = "rid"
    ) -> Generation:
        rids = (f"{prefix}-{i}" for i in itertools.count())

        def before(i: int) -> None:
            self.checks.append(i)
            if reject_before is not None and i >= reject_before:
                raise PartialRolloutStalenessExceeded("cap")

        async def on_chunk(c: ChunkOutcome) -> None:
            await self.recording.wait()
            self.chunks.append(c)

        return await generate_preemptible(
            req, engine=self.engine, controller=self.controller, new_rid=lambda: next(rids),
            before_chunk=before, on_chunk=on_chunk,
        )


def harness() -> Harness:
    return Harness(FakeEngine(), PauseController())


def test_single_chunk_stop() -> None:
    async def body() -> None:
        h = harness()
        task = asyncio.create_task(h.generate(request()))
        call = await h.engine.wait_calls(1)
        assert call.input_ids == list(PROMPT) and call.max_new == 10
        assert [a.rid for a in h.controller.active()] == ["rid-0"]
        h.engine.answer(call, [7, 8], "stop")
        gen = await task
        assert gen.output_ids == [7, 8] and gen.finish_reason == "stop"
        assert [c.context_ids for c in h.chunks] == [PROMPT]
        assert h.controller.active() == []

    run(body)


def test_budget_is_bounded_by_context_window() -> None:
    async def body() -> None:
        h = harness()
        task = asyncio.create_task(h.generate(request(budget=100, window=10)))
        call = await h.engine.wait_calls(1)
        assert call.max_new == 10 - len(PROMPT)
        h.engine.answer(call, [5] * 7, "length")
        assert (await task).finish_reason == "length"

    run(body)


def test_pause_preempts_holds_and_resumes_with_remaining_budget() -> None:
    async def body() -> None:
        h = harness()
        task = asyncio.create_task(h.generate(request(budget=10)))
        first = await h.engine.wait_calls(1)
        h.engine.partial["rid-0"] = [7, 8, 9]
        result = await h.controller.pause("weight_update", 2.0, h.engine.abort_many)
        assert result.status == "paused" and result.quiesced and result.active == 0
        assert result.preempted == ["rid-0"]
        assert first.result.result().finish_reason == "abort"
        while h.controller.held == 0:  # the loop parks itself right after releasing the chunk
            await asyncio.sleep(0)
        assert len(h.engine.calls) == 1  # nothing admitted while paused
        h.engine.version = "v2"
        assert h.controller.resume() == "resumed"
        second = await h.engine.wait_calls(2)
        assert second.input_ids == [*PROMPT, 7, 8, 9] and second.max_new == 7
        h.engine.answer(second, [10, 11], "stop")
        gen = await task
        assert gen.output_ids == [7, 8, 9, 10, 11]
        assert gen.versions == ["v1"] * 3 + ["v2"] * 2
        assert [c.context_ids for c in h.chunks] == [PROMPT, ()]
        assert [c.chunk_index for c in h.chunks] == [0, 1]
        assert h.checks == [0, 1]  # pre-check before every chunk

    run(body)


def test_natural_stop_is_never_resumed_even_if_abort_succeeded() -> None:
    """W7: the engine finished the chunk before the abort; 'found' or not, it is final."""

    async def body() -> None:
        h = harness()
        task = asyncio.create_task(h.generate(request()))
        call = await h.engine.wait_calls(1)
        h.engine.answer(call, [7, 0], "stop")  # finished naturally; abort arrives after
        h.engine.abort_finds = ["accepted"]
        result = await h.controller.pause("weight_update", 2.0, h.engine.abort_many)
        gen = await task
        assert result.quiesced and result.preempted == []
        assert gen.output_ids == [7, 0] and gen.finish_reason == "stop"
        assert len(h.engine.calls) == 1

    run(body)


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


def test_abort_without_partial_rollout_raises_preempted() -> None:
    async def body() -> None:
        h = harness()
        task = asyncio.create_task(h.generate(request(partial=False)))
        await h.engine.wait_calls(1)
        h.engine.partial["rid-0"] = [7]
        await h.controller.pause("weight_update", 2.0, h.engine.abort_many)
        with pytest.raises(GenerationPreempted):
            await task
        assert len(h.chunks) == 1  # the aborted chunk was still handed over (published) first

    run(body)


def test_abort_with_budget_spent_finishes_as_length() -> None:
    async def body() -> None:
        h = harness()
        task = asyncio.create_task(h.generate(request(budget=3)))
        await h.engine.wait_calls(1)
        h.engine.partial["rid-0"] = [7, 8, 9]
        await h.controller.pause("weight_update", 2.0, h.engine.abort_many)
        gen = await task
        assert gen.finish_reason == "length" and h.controller.held == 0

    run(body)


def test_pre_check_rejects_without_calling_the_engine() -> None:
    async def body() -> None:
        h = harness()
        with pytest.raises(PartialRolloutStalenessExceeded):
            await h.generate(request(), reject_before=0)
        assert h.engine.calls == [] and h.controller.active() == []

    run(body)


def test_pre_check_rejects_continuation_after_resume() -> None:
    async def body() -> None:
        h = harness()
        task = asyncio.create_task(h.generate(request(), reject_before=1))
        await h.engine.wait_calls(1)
        h.engine.partial["rid-0"] = [7]
        await h.controller.pause("weight_update", 2.0, h.engine.abort_many)
        h.controller.resume()
        with pytest.raises(PartialRolloutStalenessExceeded):
            await task
        assert len(h.engine.calls) == 1

    run(body)


def test_post_chunk_error_stops_at_once() -> None:
    async def body() -> None:
        h = harness()

        async def on_chunk(c: ChunkOutcome) -> None:
            raise PartialRolloutStalenessExceeded("after chunk")

        task = asyncio.create_task(generate_preemptible(
            request(), engine=h.engine, controller=h.controller, new_rid=lambda: "r",
            before_chunk=lambda i: None, on_chunk=on_chunk,
        ))
        call = await h.engine.wait_calls(1)
        h.engine.answer(call, [1], "abort")
        with pytest.raises(PartialRolloutStalenessExceeded):
            await task
        assert len(h.engine.calls) == 1 and h.controller.active() == []

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


def test_engine_that_always_aborts_is_bounded() -> None:
    async def body() -> None:
        h = harness()
        answered = 0

        async def answer_all() -> None:
            nonlocal answered
            while True:
                call = await h.engine.wait_calls(answered + 1)
                h.engine.answer(call, [], "abort")
                answered += 1

        helper = asyncio.create_task(answer_all())
        with pytest.raises(EngineError):
            await h.generate(request())
        helper.cancel()
        assert len(h.engine.calls) == 8

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
