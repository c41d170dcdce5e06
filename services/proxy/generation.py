"""Preemptible generation and the pause controller (no HTTP, no Kafka here).

Pause is ONE flag for the whole proxy (a weight update concerns every engine this
proxy talks to); aborts name request ids, every rid in flight on one engine in one call
where the engine takes that (rein's ``/abort_requests``). Lifecycle of one engine request::

    admit (waits while paused) ─▶ active ─▶ stopped on the engine ─▶ engine answers ─▶ on_chunk
    (submit the chunk's records, record it, post-checks) ─▶ released (its ``done`` event fires)

A pause counts a request quiesced once it is *stopped*: the engine confirmed it no longer runs
it (rein's engine answers the abort with the rid aborted now or already finished), or it was
released. So a pause costs the abort round trip, not the proxy's backlog of answers to process
(each answer is still recorded and submitted when processed; the records' acks are not waited
for). An engine that only accepts the abort (SGLang) is waited on until the release.

and of one chat call::

    chunk 0 ─▶ stop | length ─────────────────────────────▶ return
         └──▶ abort ─▶ (partial rollout off) ─────────────▶ GenerationPreempted
                   └─▶ held until resume ─▶ chunk 1 (prompt + tokens so far,
                                             remaining budget) ─▶ ...

Only a chunk whose *engine* finish reason is ``abort`` is continued. A chunk that
ended naturally (stop / length) is final even when an abort for it was reported as
successful: the model chose that end, and continuing would generate past it. Every wait
is on an ``asyncio.Event``; the only timed loop re-sends an abort that reached the engine before its ``/generate`` did
(bounded by the pause timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from services.proxy.engine_client import AbortOutcome, EngineOutput, FinishReason, Sampling
from shared.errors import EngineError, EngineUnavailable, GenerationPreempted


@dataclass(eq=False)
class ActiveRequest:
    """One engine request in flight."""

    rid: str
    engine: str
    session_id: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Released: its answer was processed (or it failed)."""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    """Not running on its engine any more: released, or the engine confirmed the abort or its end."""
    finish_reason: FinishReason | None = None
    engine_aborted: bool = False
    """The engine answered the abort with this request ended by it (before the answer was processed)."""


@dataclass(frozen=True)
class PauseResult:
    status: str
    """``paused`` or ``already_paused``."""
    quiesced: bool
    """True only when no engine request of this proxy runs on an engine any more (each ended there;
    the answers of some may still be being recorded: their tokens and versions are fixed)."""
    preempted: list[str]
    """Rids whose engine request ended as ``abort`` because of this pause."""
    aborts_sent: list[str]
    active: int
    """Engine requests not known to be stopped (non-zero exactly when not quiesced)."""
    waited_s: float
    pause_id: str = ""
    """The pause this answer is about; a renew or resume naming another pause is refused."""
    lease_s: float = 0.0
    """The pause ends by itself this long after the answer unless it is renewed."""


ResumeStatus = Literal["resumed", "already_running", "stale"]
"""``stale``: the resume named a pause that is not the proxy's current one (refused, nothing changed)."""


AbortFn = Callable[[Sequence[ActiveRequest]], Awaitable[Mapping[str, AbortOutcome]]]
"""Aborts requests that all run on one engine (one call where the engine takes many rids); what
the engine said of each rid (a rid missing from the answer counts as ``unknown``)."""


class PauseController:
    """The pause flag, the engine requests in flight and the generations held for resume.

    A pause has an id and a lease: it ends by itself once the lease runs out without a
    renewal (:meth:`expired`), so a broadcaster killed between pause and resume cannot hold
    every agent forever. A newer pause takes the pause over (its id replaces the old one);
    a renewal or resume naming any other id is refused. A resume without an id (an operator,
    or a broadcaster's start-up recovery) always resumes.

    ``clock`` reads the time leases and closed admission are measured in (tests move it by
    hand); the wait for quiescence keeps time.monotonic, as the event loop's timeouts do."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._paused = False
        self.pause_id = ""
        """Id of the current (or, when running, the last) pause."""
        self._lease_until: float | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._active: dict[str, ActiveRequest] = {}
        self.held = 0
        """Chat calls whose last chunk was preempted, waiting for resume."""
        self.reason = ""
        self.pauses = 0
        self._closed_at: float | None = None
        """When the current pause closed admission (taken-over pauses keep the first one's time)."""

    @property
    def paused(self) -> bool:
        return self._paused

    def active(self) -> list[ActiveRequest]:
        return list(self._active.values())

    def closed_s(self) -> float | None:
        """Seconds admission has been closed by the current pause; None while running."""
        return None if self._closed_at is None or not self._paused else self._clock() - self._closed_at

    async def wait_running(self) -> None:
        while self._paused:
            await self._running.wait()

    async def admit(self, rid: str, engine: str, session_id: str) -> ActiveRequest:
        """Wait until not paused, then register ``rid`` as in flight (atomically: no await in between)."""
        await self.wait_running()
        request = ActiveRequest(rid=rid, engine=engine, session_id=session_id)
        self._active[rid] = request
        return request

    def release(self, request: ActiveRequest, finish_reason: FinishReason | None) -> None:
        """The request's output is kept (or it failed): it no longer holds up a pause."""
        request.finish_reason = finish_reason
        self._active.pop(request.rid, None)
        request.done.set()
        request.stopped.set()

    async def hold(self) -> None:
        """Park a preempted generation until resume."""
        self.held += 1
        try:
            await self.wait_running()
        finally:
            self.held -= 1

    async def pause(
        self, reason: str, timeout_s: float, abort: AbortFn, abort_retry_s: float = 0.05, *,
        pause_id: str = "", lease_s: float = 60.0,
    ) -> PauseResult:
        """Stop admitting, abort everything in flight, wait (bounded) until each request is stopped.

        The lease starts when the wait ends (the wait has its own bound)."""
        start = time.monotonic()
        status = "already_paused" if self._paused else "paused"
        if not self._paused:
            self.pauses += 1
            self._closed_at = self._clock()
        self._paused = True
        self._running.clear()
        self.reason = reason
        mine = self.pause_id = pause_id or self.pause_id
        self._lease_until = None  # no expiry while this pause waits for quiescence
        targets = self.active()
        deadline = start + timeout_s
        if targets:
            by_engine: dict[str, list[ActiveRequest]] = {}
            for t in targets:
                by_engine.setdefault(t.engine, []).append(t)
            tasks = [asyncio.create_task(_abort_until_released(group, abort, deadline, abort_retry_s))
                     for group in by_engine.values()]
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
            for task in pending:
                task.cancel()
        still = [r for r in self.active() if not r.stopped.is_set()]
        if self._paused and self.pause_id == mine:  # not resumed nor taken over meanwhile
            self._lease_until = self._clock() + lease_s
        return PauseResult(
            status=status,
            quiesced=not still,
            preempted=[t.rid for t in targets if t.engine_aborted or t.finish_reason == "abort"],
            aborts_sent=[t.rid for t in targets],
            active=len(still),
            waited_s=time.monotonic() - start,
            pause_id=self.pause_id,
            lease_s=lease_s,
        )

    def renew(self, pause_id: str, lease_s: float) -> bool:
        """Extend the current pause's lease; False (nothing changed) if ``pause_id`` is not the current pause."""
        if not self._paused or pause_id != self.pause_id:
            return False
        self._lease_until = self._clock() + lease_s
        return True

    def lease_left_s(self) -> float | None:
        """Seconds until the current pause expires; None when running or while a pause waits to quiesce."""
        if not self._paused or self._lease_until is None:
            return None
        return self._lease_until - self._clock()

    def expired(self) -> bool:
        left = self.lease_left_s()
        return left is not None and left <= 0

    def resume(self, pause_id: str | None = None) -> ResumeStatus:
        """Release held generations and admissions, unless ``pause_id`` names another pause."""
        if pause_id is not None and pause_id != self.pause_id:
            return "stale"
        was = self._paused
        self._paused = False
        self._closed_at = None
        self._lease_until = None
        self.reason = ""
        self._running.set()
        return "resumed" if was else "already_running"


async def _abort_until_released(
    requests: Sequence[ActiveRequest], abort: AbortFn, deadline: float, first_delay: float
) -> None:
    """Abort one engine's ``requests`` until each is stopped: an abort the engine confirms stops a
    request at once; one only accepted waits for its release; a rid the engine did not know yet
    (the abort overtook its ``/generate``) is sent again with backoff, in one call with any other
    such rid. Bounded by ``deadline``."""
    delay = first_delay
    send = [r for r in requests if not r.stopped.is_set()]
    while send:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        try:
            outcomes = await abort(send)
        except (EngineUnavailable, EngineError):
            outcomes = {}
        retry: list[ActiveRequest] = []
        for request in send:
            outcome = outcomes.get(request.rid, "unknown")
            if outcome in ("aborted", "finished"):
                request.engine_aborted = outcome == "aborted"
                request.stopped.set()
            elif outcome == "unknown" and not request.stopped.is_set():
                retry.append(request)
        send = retry
        if send:
            await _stopped(send, min(delay, deadline - time.monotonic()))
            send = [r for r in send if not r.stopped.is_set()]
            delay = min(delay * 2, 1.0)
    await _stopped(requests, deadline - time.monotonic())  # the accepted ones: until their release


async def _stopped(requests: Sequence[ActiveRequest], timeout_s: float) -> None:
    """Until every request of ``requests`` is stopped, at most ``timeout_s``."""
    if timeout_s <= 0:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(r.stopped.wait() for r in requests)), timeout_s)


# --------------------------------------------------------------------------- the generation loop


class Engine(Protocol):
    url: str

    async def generate(
        self, rid: str, input_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids: Sequence[int]
    ) -> EngineOutput: ...


@dataclass(frozen=True)
class ChunkOutcome:
    chunk_index: int
    context_ids: tuple[int, ...]
    """New context before this chunk's output: the turn's context for chunk 0, empty after."""
    output: EngineOutput
    sampling: Sampling | None = None
    """The parameters the engine sampled the output with (recorded on the chunk for the trainer)."""


@dataclass
class Generation:
    """The stitched result of one chat call."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    chunks: list[ChunkOutcome] = field(default_factory=list)
    finish_reason: FinishReason = "stop"


@dataclass(frozen=True)
class GenerationRequest:
    session_id: str
    prompt_ids: tuple[int, ...]
    context_ids: tuple[int, ...]
    budget: int
    """Output tokens the whole call may produce (over all chunks)."""
    window: int
    """Context window: prompt + output never exceeds it."""
    sampling: Sampling
    partial_rollout: bool
    max_chunks: int
    stop_ids: tuple[int, ...] = ()


async def generate_preemptible(
    req: GenerationRequest,
    *,
    engine: Engine,
    controller: PauseController,
    new_rid: Callable[[], str],
    before_chunk: Callable[[int], None],
    on_chunk: Callable[[ChunkOutcome], Awaitable[None]],
) -> Generation:
    """Run one chat call's generation, continuing it after each preempt.

    ``before_chunk(i)`` runs once the chunk is admitted and before the engine is
    called: it raises to reject without spending compute (span pre-check).
    ``on_chunk`` submits the chunk's records (without waiting for their acks), records
    the chunk and runs the post-checks; it raises to stop at once. The request stays
    registered until ``on_chunk`` returns; a pause waits for it only until the engine
    confirms it stopped (or, without that, until then).
    """
    gen = Generation()
    for chunk_index in range(req.max_chunks):
        input_ids = (*req.prompt_ids, *gen.output_ids)
        max_new = min(req.budget - len(gen.output_ids), req.window - len(input_ids))
        rid = new_rid()
        active = await controller.admit(rid, engine.url, req.session_id)
        finish: FinishReason | None = None
        try:
            before_chunk(chunk_index)
            out = await engine.generate(rid, input_ids, max_new, req.sampling, req.stop_ids)
            finish = out.finish_reason
            outcome = ChunkOutcome(chunk_index, req.context_ids if chunk_index == 0 else (), out, req.sampling)
            gen.chunks.append(outcome)
            gen.output_ids.extend(out.output_ids)
            gen.logprobs.extend(out.logprobs)
            gen.versions.extend(out.token_versions)
            await on_chunk(outcome)
        finally:
            controller.release(active, finish)
        if out.finish_reason != "abort":
            gen.finish_reason = out.finish_reason
            return gen
        if not req.partial_rollout:
            raise GenerationPreempted(
                f"generation of session {req.session_id} was preempted and partial rollout is off",
                session_id=req.session_id, rid=rid, tokens_kept=len(gen.output_ids),
            )
        if len(gen.output_ids) >= req.budget or len(req.prompt_ids) + len(gen.output_ids) >= req.window:
            gen.finish_reason = "length"
            return gen
        await controller.hold()
    raise EngineError(
        f"generation of session {req.session_id} was aborted {req.max_chunks} times; giving up",
        session_id=req.session_id, chunks=req.max_chunks,
    )
