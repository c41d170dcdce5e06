"""The preemptible generation loop against an in-memory engine: chunks, budgets, resumption after a
pause, and the checks before and after each chunk that end a generation."""

from __future__ import annotations

import asyncio

import pytest

from services.proxy.generation import ChunkOutcome, generate_preemptible
from shared.errors import EngineError, GenerationPreempted, PartialRolloutStalenessExceeded
from tests.support.generation_engine import PROMPT, harness, request, run


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
