"""An in-memory engine and a harness for the tests of the preemptible generation loop and its pause
controller: ``FakeEngine`` answers nothing by itself (each generate call waits until the test answers it
or an abort ends it), so a test sets the order of every answer, abort and pause; ``Harness`` runs
``generate_preemptible`` on it and records each chunk handed over."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from services.proxy.engine_client import AbortOutcome, EngineOutput, FinishReason, Sampling
from services.proxy.generation import (
    ActiveRequest,
    ChunkOutcome,
    Generation,
    GenerationRequest,
    PauseController,
    generate_preemptible,
)
from shared.errors import PartialRolloutStalenessExceeded

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
