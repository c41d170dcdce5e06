"""The asyncio driver: concurrent callers, abort, cancellation, weight updates."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from services.engine.batcher import Batcher, StepReport, Weights
from services.engine.runner import EngineRunner, EngineUnavailableError, WeightUpdateError
from services.engine.sampling import SamplingParams
from shared import checkpoint
from shared.policy import PolicyConfig, init_policy
from shared.tokenizer import TOKENIZER

CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size, context=32, width=16, layers=1, heads=2)
PROMPT = TOKENIZER.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True)
T = TypeVar("T")


def make_runner(weights_dir: Path, step_delay_s: float = 0.0) -> tuple[EngineRunner, list[int]]:
    model = init_policy(CFG, 0).eval()
    w = Weights(model, "v0", checkpoint.digest(model.state_dict()), 0, None)
    sizes: list[int] = []

    def on_step(report: StepReport) -> None:
        sizes.append(report.batch_size)

    runner = EngineRunner(
        Batcher(w, end_id=TOKENIZER.end_id), weights_dir=weights_dir, device=torch.device("cpu"),
        vocab_size=TOKENIZER.vocab_size, step_delay_s=step_delay_s, on_step=on_step,
    )
    return runner, sizes


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(body(), timeout=20))


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.005)


def test_concurrent_generates_are_batched(tmp_path: Path) -> None:
    async def body() -> None:
        runner, sizes = make_runner(tmp_path)
        runner.start()
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        reqs = await asyncio.gather(*(runner.generate(f"r{i}", PROMPT, params) for i in range(4)))
        await runner.stop()
        assert all(r.finish_type == "length" and len(r.output_ids) == 5 for r in reqs)
        assert max(sizes) == 4

    run(body)


def test_abort_and_cancel(tmp_path: Path) -> None:
    async def body() -> None:
        runner, _ = make_runner(tmp_path, step_delay_s=0.01)
        runner.start()
        params = SamplingParams(max_new_tokens=25, ignore_eos=True)
        task = asyncio.create_task(runner.generate("a", PROMPT, params))
        gone = asyncio.create_task(runner.generate("b", PROMPT, params))
        await until(lambda: runner.batcher.active_rids() == ["a", "b"])
        assert runner.abort("nope", abort_all=False) == []
        assert runner.abort("a", abort_all=False) == ["a"]
        req = await task
        assert req.finish_type == "abort" and len(req.output_ids) < 25
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert runner.batcher.active_rids() == []
        await runner.stop()

    run(body)


def test_update_weights(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    wdir = tmp_path / "weights"
    wdir.mkdir()
    outside.mkdir()
    dig = checkpoint.save(wdir / "c1.pt", init_policy(CFG, 1), CFG, version="v1", step=1)
    checkpoint.save(outside / "c.pt", init_policy(CFG, 1), CFG, version="evil", step=1)
    (wdir / "link.pt").symlink_to(outside / "c.pt")

    async def body() -> None:
        runner, _ = make_runner(wdir)
        runner.start()
        for bad, why in [
            (str(outside / "c.pt"), "outside"),
            ("../outside/c.pt", "outside"),
            ("link.pt", "outside"),
            ("missing.pt", "does not exist"),
        ]:
            with pytest.raises(WeightUpdateError, match=why):
                await runner.update_weights(bad, None, False)
        result = await runner.update_weights("c1.pt", None, False)
        assert (result.version, result.digest) == ("v1", dig)
        relabelled = await runner.update_weights(str(wdir / "c1.pt"), "v1b", False)
        assert runner.batcher.weights.version == relabelled.version == "v1b"
        await runner.stop()

    run(body)


def test_dead_decode_loop_fails_callers_loudly(tmp_path: Path) -> None:
    async def body() -> None:
        runner, _ = make_runner(tmp_path)

        def broken_step() -> StepReport:
            raise RuntimeError("boom")

        runner.batcher.step = broken_step  # type: ignore[method-assign]
        runner.start()
        with pytest.raises(EngineUnavailableError, match="boom"):
            await runner.generate("r", PROMPT, SamplingParams(max_new_tokens=3))
        assert not runner.healthy
        with pytest.raises(EngineUnavailableError, match="not running"):
            await runner.generate("r2", PROMPT, SamplingParams(max_new_tokens=3))
        await runner.stop()

    run(body)
