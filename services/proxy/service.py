"""What each proxy endpoint does, without HTTP: chat call, finish, pause, resume, state.

:class:`ProxyService` wires the session store, the engines, the pause controller
and the publisher. Routes (``app.py``) only parse HTTP and call it.

When records are published (the collector relies on this):

- ``Chunk``: one per engine call of a training session (one with ``X-Group-Id``),
  written and acked before the next engine call and before the agent's answer.
- ``SessionFinished``: on ``POST /v1/sessions/{id}/finish``; ``num_chunks`` = every
  chunk the session published.
- ``SessionRejected``: when a staleness rule rejects the session (span cap, version
  change, preempt without partial rollout; soft or not), and when a call fails
  after it already published a chunk (engine lost mid-call, Kafka failure) — then
  the records on Kafka could not be completed. ``num_chunks`` counts the chunks
  published, the rejected call's included. The session is final afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.proxy.engine_client import EngineHandle, Sampling, pick_engine
from services.proxy.generation import (
    ActiveRequest,
    ChunkOutcome,
    Generation,
    GenerationRequest,
    PauseController,
    PauseResult,
    generate_preemptible,
)
from services.proxy.metrics import ProxyMetrics
from services.proxy.publisher import Publisher
from services.proxy.sessions import Session, SessionStore, TurnPlan
from services.proxy.settings import ProxySettings
from shared import log
from shared.errors import (
    ContextOverflow,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    KafkaUnavailable,
    PartialRolloutStalenessExceeded,
    ReinError,
    RolloutRejected,
    SessionBusy,
    SessionIdle,
    StalePause,
    TrajectoryVersionChanged,
)
from shared.schemas import Chunk, SessionFinished, SessionRejected, new_id
from shared.staleness import check_span
from shared.tokenizer import Tokenizer
from shared.versions import distinct_real, encode_runs, real_version

_log = log.get(__name__)


@dataclass(frozen=True)
class CallIds:
    """Identity of one chat call, from its headers."""

    session_id: str
    group_id: str = ""
    turn_id: str = ""
    prompt_id: str = ""
    attempt: int = 0


@dataclass(frozen=True)
class ChatOutcome:
    """A finished chat call: the text and what the response's ``rein`` field reports."""

    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    rein: dict[str, Any]
    soft_rejected: bool = False


class ProxyService:
    def __init__(
        self,
        settings: ProxySettings,
        engines: list[EngineHandle],
        publisher: Publisher,
        controller: PauseController,
        metrics: ProxyMetrics,
        tokenizer: Tokenizer,
        new_rid: Callable[[], str] = lambda: new_id("rein"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.engines = engines
        self.publisher = publisher
        self.controller = controller
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.sessions = SessionStore(settings.finalized_memory, clock)
        self._new_rid = new_rid

    # ------------------------------------------------------------------ chat

    async def chat(
        self,
        ids: CallIds,
        messages: list[tuple[str, str]],
        *,
        budget: int,
        sampling: Sampling,
        soft_reject: bool,
    ) -> ChatOutcome:
        session = self.sessions.acquire(ids.session_id, ids.group_id, ids.prompt_id, ids.attempt)
        self.metrics.sessions.set(len(self.sessions))
        published_before = session.num_chunks
        plan: TurnPlan | None = None
        try:
            try:
                plan = session.plan(messages, self.tokenizer)
            except ValueError as exc:
                raise InvalidRequest(str(exc), fields=[{"field": "messages", "message": str(exc)}]) from None
            engine = pick_engine(ids.session_id, self.engines)
            window = await engine.window()
            room = window - len(plan.prompt_ids)
            if room < 1:
                raise ContextOverflow(
                    f"prompt of {len(plan.prompt_ids)} tokens leaves no room in the context window of {window}",
                    phase="prompt", context_window=window, input_tokens=len(plan.prompt_ids), max_tokens=budget,
                    session_id=ids.session_id, turn_id=ids.turn_id, segment_index=plan.segment_index,
                )
            request = GenerationRequest(
                session_id=ids.session_id, prompt_ids=plan.prompt_ids, context_ids=plan.context_ids,
                budget=budget, window=window, sampling=sampling, partial_rollout=self.settings.partial_rollout,
                max_chunks=self.settings.max_chunks_per_call,
            )
            current_plan = plan
            gen = await generate_preemptible(
                request,
                engine=engine,
                controller=self.controller,
                new_rid=self._new_rid,
                before_chunk=lambda _i: self._pre_check(session, engine),
                on_chunk=lambda outcome: self._on_chunk(session, ids, current_plan, engine, outcome),
            )
        except RolloutRejected as exc:
            await self._reject(session, exc, soft=soft_reject)
            if not soft_reject:
                raise
            return ChatOutcome(
                content="", finish_reason="stop", prompt_tokens=0, completion_tokens=0,
                rein={"session_id": ids.session_id, "rejected": exc.detail()}, soft_rejected=True,
            )
        except Exception as exc:
            if plan is not None and session.num_chunks > published_before:
                # Records of this call are on Kafka but the call cannot finish: the
                # trajectory cannot be completed, so the session is rejected.
                session.close_segment(plan)
                error = exc if isinstance(exc, ReinError) else ReinError(f"{type(exc).__name__}: {exc}")
                await self._reject(session, error, soft=False)
            raise
        except BaseException:
            # Cancelled (shutdown): no awaiting here; a call that published chunks
            # cannot be completed, so the session takes no more calls.
            if plan is not None and session.num_chunks > published_before:
                session.close_segment(plan)
                self.sessions.finalize(session, "rejected (cancelled)")
            raise
        finally:
            self.sessions.release(session)
            self.metrics.sessions.set(len(self.sessions))
        content = self.tokenizer.decode(gen.output_ids)
        session.complete_turn(plan, tuple(self.tokenizer.render_message("assistant", content)))
        return ChatOutcome(
            content=content,
            finish_reason=gen.finish_reason,
            prompt_tokens=len(plan.prompt_ids),
            completion_tokens=len(gen.output_ids),
            rein=_rein_info(ids.session_id, plan, gen),
        )

    def _pre_check(self, session: Session, engine: EngineHandle) -> None:
        """Before an engine call: reject if the engine's current version would break a rule."""
        candidate = [engine.version] if engine.version is not None else []
        self._check_versions(session, candidate)

    def _check_versions(self, session: Session, candidates: Sequence[str | None]) -> None:
        recorded = session.versions()
        if self.settings.partial_rollout:
            rejection = check_span(recorded, candidates, self.settings.max_preempts, session.session_id)
            if rejection is not None:
                raise PartialRolloutStalenessExceeded.from_detail(rejection.detail())
            return
        new = [v for v in distinct_real(candidates) if v not in recorded]
        if recorded and new:
            raise TrajectoryVersionChanged(
                f"session {session.session_id} was generated with {recorded}; the engine now serves {new} "
                "and partial rollout is off",
                previous_versions=recorded, new_versions=new, session_id=session.session_id,
            )

    async def _on_chunk(
        self, session: Session, ids: CallIds, plan: TurnPlan, engine: EngineHandle, outcome: ChunkOutcome
    ) -> None:
        out = outcome.output
        self.metrics.tokens.inc(len(out.output_ids))
        if out.finish_reason == "abort":
            self.metrics.preempts.inc()
        # The post-check compares against what the session held *before* this chunk.
        candidates = [out.version, *out.token_versions]
        seq = session.num_chunks
        if session.trainable:
            record = Chunk(
                session_id=ids.session_id, group_id=ids.group_id, prompt_id=ids.prompt_id, attempt=ids.attempt,
                turn_id=ids.turn_id, seq=seq, segment_index=plan.segment_index, chunk_index=outcome.chunk_index,
                context_ids=list(outcome.context_ids), output_ids=list(out.output_ids), logprobs=list(out.logprobs),
                version=out.version, token_versions=encode_runs(out.token_versions), finish_reason=out.finish_reason,
                rid=out.rid, engine=engine.url,
            )
            try:
                await self.publisher.send(self.settings.topics.chunks, record)
            except KafkaUnavailable:
                self.metrics.publish_failures.labels(record="chunk").inc()
                session.close_segment(plan)
                raise
            self.metrics.chunks.inc()
        check_error: RolloutRejected | None = None
        try:
            self._check_versions(session, candidates)
        except RolloutRejected as exc:
            check_error = exc
        session.record_chunk(plan, outcome.context_ids, out.output_ids, out.token_versions)
        if check_error is not None:
            raise check_error

    async def _reject(self, session: Session, error: ReinError, *, soft: bool) -> None:
        """Finalize the session as rejected and publish SessionRejected (best effort for Kafka failures)."""
        self._finalize_rejected(session, error, soft=soft)
        try:
            await self._publish_rejection(session, error)
        except KafkaUnavailable as exc:
            if isinstance(error, RolloutRejected):
                raise  # the agent must not get a soft 200 when the rejection is not on record
            _log.error("session_rejected_not_published", session_id=session.session_id, error=str(exc))

    def _finalize_rejected(self, session: Session, error: ReinError, *, soft: bool) -> None:
        self.sessions.finalize(session, f"rejected ({error.code})")
        self.metrics.rejections.labels(error=error.code, soft=str(soft).lower()).inc()
        _log.warning("session_rejected", session_id=session.session_id, group_id=session.group_id,
                     error=error.code, soft=soft, num_chunks=session.num_chunks)

    async def _publish_rejection(self, session: Session, error: ReinError) -> None:
        """SessionRejected on Kafka for a training session; KafkaUnavailable is counted and raised."""
        if not session.trainable:
            return
        record = SessionRejected(
            session_id=session.session_id, group_id=session.group_id, error=error.code,
            detail=_jsonable(error.detail()), num_chunks=session.num_chunks,
        )
        try:
            await self.publisher.send(self.settings.topics.events, record)
        except KafkaUnavailable:
            self.metrics.publish_failures.labels(record="session_rejected").inc()
            raise

    # ------------------------------------------------------------------ finish

    async def finish(self, session_id: str, reward: float, status: str, error: str = "") -> dict[str, Any]:
        session = self.sessions.get(session_id)
        if session.busy:
            raise SessionBusy(f"session {session_id} has a call in flight; finish it after", session_id=session_id)
        published = False
        if session.trainable:
            record = SessionFinished(
                session_id=session_id, group_id=session.group_id, reward=reward, status=status,  # type: ignore[arg-type]
                num_chunks=session.num_chunks, error=error if status == "failed" else "",
            )
            try:
                await self.publisher.send(self.settings.topics.events, record)
            except KafkaUnavailable:
                self.metrics.publish_failures.labels(record="session_finished").inc()
                raise  # the session stays open: the agent may call finish again
            published = True
        self.sessions.finalize(session, "finished")
        self.metrics.sessions.set(len(self.sessions))
        return {"session_id": session_id, "status": status, "reward": reward,
                "num_chunks": session.num_chunks, "published": published}

    # ------------------------------------------------------------------ idle sessions

    async def expire_idle(self) -> int:
        """Reject every session idle past ``session_idle_timeout_s``; returns how many.

        The rejection is on Kafka before the session is dropped: when Kafka refuses one,
        it and the rest stay live and are tried again at the next sweep. While it is being
        published the session is busy, so a late call or finish gets 409 instead of racing it.
        """
        timeout = self.settings.session_idle_timeout_s
        if not timeout:
            return 0
        expired = 0
        for session in self.sessions.idle(timeout):
            error = SessionIdle(
                f"session {session.session_id} had no call for {timeout:g}s", session_id=session.session_id,
                idle_timeout_s=timeout,
            )
            session.busy = True  # a late call or finish gets 409 while the rejection is being published
            try:
                await self._publish_rejection(session, error)
            except KafkaUnavailable as exc:
                _log.warning("idle_session_not_expired", session_id=session.session_id, error=str(exc))
                break  # Kafka is down: the rest wait for the next sweep instead of a send timeout each
            finally:
                session.busy = False
            self._finalize_rejected(session, error, soft=False)
            expired += 1
        if expired:
            self.metrics.sessions.set(len(self.sessions))
        return expired

    # ------------------------------------------------------------------ control plane

    async def pause(
        self, reason: str, timeout_s: float | None, pause_id: str | None = None, lease_s: float | None = None
    ) -> dict[str, Any]:
        engines = {e.url: e for e in self.engines}

        async def abort(request: ActiveRequest) -> bool:
            return await engines[request.engine].abort(request.rid, self.settings.engine_connect_timeout_s)

        result: PauseResult = await self.controller.pause(
            reason, timeout_s or self.settings.pause_timeout_s, abort, self.settings.abort_retry_s,
            pause_id=pause_id or new_id("pause"), lease_s=lease_s or self.settings.pause_lease_s,
        )
        self.metrics.pause_seconds.observe(result.waited_s)
        _log.info("paused", reason=reason, quiesced=result.quiesced, preempted=len(result.preempted),
                  active=result.active, waited_s=round(result.waited_s, 4), pause_id=result.pause_id,
                  lease_s=result.lease_s)
        return {
            "status": result.status, "quiesced": result.quiesced, "preempted": result.preempted,
            "aborts_sent": result.aborts_sent, "active": result.active, "held": self.controller.held,
            "waited_s": result.waited_s, "reason": reason, "pause_id": result.pause_id, "lease_s": result.lease_s,
        }

    def renew(self, pause_id: str, lease_s: float | None) -> dict[str, Any]:
        lease = lease_s or self.settings.pause_lease_s
        if not self.controller.renew(pause_id, lease):
            raise self._stale(pause_id)
        return {"status": "renewed", "pause_id": pause_id, "lease_s": lease}

    async def resume(self, version: str | None, pause_id: str | None = None) -> dict[str, Any]:
        """Release held generations. ``version`` (the label every engine now serves) becomes each
        engine's known version; without it each engine's ``/model_info`` is read (best effort), so
        the span pre-check of the held generations sees the new version before spending compute.
        With ``pause_id``, only that pause is ended (:class:`StalePause` otherwise)."""
        if pause_id is not None and pause_id != self.controller.pause_id:
            raise self._stale(pause_id)
        label = real_version(version)
        if label is not None:
            for engine in self.engines:
                engine.observe(label)
        else:
            for engine in self.engines:
                try:
                    await engine.refresh()
                except (EngineUnavailable, EngineError) as exc:
                    _log.warning("engine_info_unavailable_at_resume", engine=engine.url, error=str(exc))
        status = self.controller.resume(pause_id)
        if status == "stale":  # another pause began while the engines were read
            raise self._stale(pause_id or "")
        _log.info("resumed", version=label, status=status, held=self.controller.held, pause_id=pause_id)
        return {"status": status, "version": label, "held": self.controller.held}

    def _stale(self, pause_id: str) -> StalePause:
        return StalePause(
            f"pause {pause_id!r} is not this proxy's current pause", pause_id=pause_id,
            current=self.controller.pause_id if self.controller.paused else None,
        )

    async def expire_lease(self) -> bool:
        """End the current pause if its lease ran out: resume on what the engines report. True if it did."""
        if not self.controller.expired():
            return False
        pause_id = self.controller.pause_id
        _log.warning("pause_lease_expired", pause_id=pause_id, reason=self.controller.reason,
                     held=self.controller.held, note="no renew or resume came: resuming on the engines' versions")
        self.metrics.lease_expiries.inc()
        await self.resume(None, pause_id)
        return True

    def state(self) -> dict[str, Any]:
        active = self.controller.active()
        return {
            "paused": self.controller.paused,
            "reason": self.controller.reason,
            "pause_id": self.controller.pause_id if self.controller.paused else None,
            "lease_left_s": self.controller.lease_left_s(),
            "pauses": self.controller.pauses,
            "active": len(active),
            "active_rids": [a.rid for a in active],
            "held": self.controller.held,
            "live_sessions": len(self.sessions),
            "partial_rollout": self.settings.partial_rollout,
            "max_preempts": self.settings.max_preempts,
            "engines": [{"url": e.url, "version": e.version, "context_window": e.context_window,
                         "requests": e.requests} for e in self.engines],
            "time": time.time(),
        }


def _rein_info(session_id: str, plan: TurnPlan, gen: Generation) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "segment_index": plan.segment_index,
        "new_segment": plan.new_segment,
        "output_ids": gen.output_ids,
        "versions": gen.versions,
        "chunks": [
            {"rid": c.output.rid, "version": c.output.version, "finish_reason": c.output.finish_reason,
             "num_tokens": len(c.output.output_ids)}
            for c in gen.chunks
        ],
    }


def _jsonable(value: Any) -> Any:
    """Detail fields made msgpack/JSON safe (tuples to lists, unknown objects to strings)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
