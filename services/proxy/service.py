"""What each proxy endpoint does, without HTTP: chat call, finish, pause, resume, state.

:class:`ProxyService` wires the session store, the engines, the pause controller
and the publisher; pause, renew and resume come from its base
:class:`~services.proxy.pause_control.PauseControl`. Routes only parse HTTP and call it. Each session is
a pure state machine (:mod:`services.proxy.session_machine`): this shell feeds it
what happened, in order, and does what it answers (publish, end the session, answer).

When records are published (the collector relies on this):

- ``Chunk``: one per engine call of a training session (one with ``X-Group-Id``),
  submitted (:class:`~services.proxy.publisher.Publisher`: in order, bounded in flight)
  before the next engine call and before the agent's answer, neither of which waits for
  the broker's ack. The acks are awaited where an end record needs them.
- ``SessionFinished``: on ``POST /v1/sessions/{id}/finish``, once every chunk of the
  session is acked; ``num_chunks`` = every chunk the session published. If Kafka refused
  one, the session is rejected instead (``kafka_unavailable``) and the finish gets 503;
  so does the session's next chat call, whichever comes first.
- ``SessionRejected``: when a staleness rule rejects the session (span cap, version
  change, preempt without partial rollout; soft or not), when a call fails after it
  already published a chunk (engine lost mid-call, Kafka failure) — then the records on
  Kafka could not be completed — and when a chunk was lost or the session went idle.
  Published once the session's chunks are answered; ``num_chunks`` counts the chunks on
  Kafka (the rejected call's included, none from the first lost one). The session is
  final afterwards. A proxy that dies with chunks or ends unacked confirms no end: the
  rollout runner publishes ``session_lost`` for such sessions. With replicas, each session is kept in
  Redis between calls (:mod:`services.proxy.handoff`): another replica continues it, and a copy left
  behind on a replica that was only out of the balancer's rotation publishes nothing more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from services.proxy.auth import CallIds
from services.proxy.engine_client import EngineHandle, Sampling
from services.proxy.engine_pool import EnginePool
from services.proxy.generation import ChunkOutcome, GenerationRequest, PauseController, generate_preemptible
from services.proxy.handoff import Handoff
from services.proxy.metrics import ProxyMetrics
from services.proxy.pause_control import PauseControl
from services.proxy.publisher import Ack, Publisher
from services.proxy.replies import ChatOutcome, ForceCall, ToolCalls
from services.proxy.session_machine import Step, TurnPlan, VersionRules
from services.proxy.session_snapshot import UnreadableSnapshot
from services.proxy.sessions import Session, SessionStore
from services.proxy.settings import ProxySettings
from shared import log
from shared.errors import ContextOverflow, EngineLost, EngineUnavailable, KafkaUnavailable, SessionBusy, SessionMoved
from shared.membership import advertised
from shared.model.chat import ChatTokenizer
from shared.model.tool_calls import ToolCallFormat
from shared.names import RedisKeys
from shared.schemas import Chunk, Record, new_id

__all__ = ["CallIds", "ChatOutcome", "ProxyService"]

_log = log.get(__name__)


class ProxyService(PauseControl):
    """The proxy's endpoints over its session store, engines, pause controller and publisher."""

    def __init__(
        self,
        settings: ProxySettings,
        engines: EnginePool,
        publisher: Publisher,
        controller: PauseController,
        metrics: ProxyMetrics,
        tokenizer: ChatTokenizer,
        new_rid: Callable[[], str] = lambda: new_id("rein"),
        clock: Callable[[], float] = time.monotonic,
        state: redis.Redis | None = None,
    ) -> None:
        """``state``: the proxy's Redis client, where sessions are kept for other replicas (``session_handoff``
        with ``advertise_url``)."""
        self.settings = settings
        self.engines = engines
        self.publisher = publisher
        self.controller = controller
        self.metrics = metrics
        rules = VersionRules(partial_rollout=settings.partial_rollout, max_preempts=settings.max_preempts)
        tool_calls = None if settings.tool_call_parser == "auto" else ToolCallFormat(settings.tool_call_parser)
        self.sessions = SessionStore(settings.finalized_memory, clock, tokenizer=tokenizer, rules=rules,
                                     tool_calls=tool_calls, rewritten_history=settings.rewritten_history)
        self._stop_ids = tuple(sorted(tokenizer.stop_ids))
        """The model's EOS and end-of-turn ids, sent on every ``/generate``: an engine that knows only its
        EOS (SGLang reads the model's config) would run past an end of turn that is not the EOS."""
        self._new_rid = new_rid
        self._acks: dict[str, dict[int, Ack]] = {}
        """Per session id, its chunks' acks not looked at yet, by seq (the pure machine holds no futures)."""
        kafka = settings.kafka
        self._ack_bound_s = (kafka.linger_ms + kafka.request_timeout_ms + kafka.max_block_ms) / 1000 + 5
        """Past this an unanswered chunk counts as lost (the producer answers each one sooner)."""
        self.handoff: Handoff | None = None
        """Sessions kept in Redis for another replica to continue (None: they live only here)."""
        if state is not None and settings.session_handoff and settings.advertise_url:
            idle, owner = settings.session_idle_timeout_s, f"{advertised(settings.advertise_url)}#{new_id('p')}"
            self.handoff = Handoff(state, RedisKeys(settings.redis.key_prefix), owner,
                                   idle + 60 if idle else settings.session_key_ttl_s, self._ack_bound_s, metrics)

    # ------------------------------------------------------------------ chat

    async def chat(
        self,
        ids: CallIds,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        budget: int,
        sampling: Sampling,
        soft_reject: bool,
        calls: ToolCalls = "all",
        force: ForceCall | None = None,
    ) -> ChatOutcome:
        """Acquire the session, plan the turn, generate (submitting each chunk), answer.

        Whatever stops the call is fed to the session once (``fail``/``cancel``) and its
        step is carried out: end the session, publish the rejection, answer. The session's
        acks are awaited first, so a rejection counts exactly the chunks on Kafka."""
        await self._take_over(ids.session_id)
        session = self.sessions.acquire(ids.session_id, ids.group_id, ids.prompt_id, ids.attempt)
        self.metrics.sessions.set(len(self.sessions))
        try:
            self._look(session)
            await self._mark_call(session)
            plan = session.begin(messages, ids.turn_id, tools, force)
            engine = self.engines.route(session)
            request = self._request(plan, await engine.window(), ids, budget, sampling)
            gen = await generate_preemptible(
                request,
                engine=engine,
                controller=self.controller,
                new_rid=self._new_rid,
                before_chunk=lambda _i: _raise(session.check_engine(engine.version)),
                on_chunk=lambda outcome: self._on_chunk(session, engine, plan, outcome),
            )
            outcome = session.complete(gen, stop=sampling.stop, calls=calls)
            if outcome.call_markup is not None:
                self.metrics.tool_call_replies.labels(outcome=outcome.call_markup).inc()
            return outcome
        except Exception as exc:
            if isinstance(exc, EngineUnavailable) and not isinstance(exc, EngineLost):
                exc = self.engines.call_failed(session, exc)
            await self._settle(session)
            step = session.fail(exc, soft=soft_reject)
            await self._carry_out(session, step)
            if step.answer is not None:
                return step.answer
            assert step.error is not None
            raise step.error from None  # ``exc`` itself, or the rejection it became
        except BaseException:
            self._end(session, session.cancel())  # cancelled (shutdown): nothing to await here
            raise
        finally:
            self.sessions.release(session)
            self.metrics.sessions.set(len(self.sessions))
            self._save(session)

    async def _take_over(self, session_id: str) -> None:
        """Continue here a session another replica held, from its snapshot (:mod:`services.proxy.handoff`)."""
        if self.handoff is None or self.sessions.holds(session_id):
            return
        state = await self.handoff.take(session_id)
        if state is None or self.sessions.holds(session_id):  # a new session, or adopted by a call meanwhile
            return
        try:
            session = self.sessions.adopt(state)
        except UnreadableSnapshot as exc:
            self.handoff.taken(session_id, unreadable=str(exc))  # raises session_interrupted
        else:
            self.engines.adopt(session)
            self.handoff.taken(session_id)

    async def _mark_call(self, session: Session) -> None:
        """Mark a call (a finish, an expiry) begun in Redis; a session another replica took over meanwhile is
        dropped here (409 ``session_moved``): this copy must publish nothing more."""
        if self.handoff is None:
            return
        try:
            await self.handoff.begin(session.session_id)
        except SessionMoved:
            self._acks.pop(session.session_id, None)
            self.engines.release(session)
            self.sessions.finalize(session, "moved to another proxy replica")
            _log.warning("session_moved", session_id=session.session_id, group_id=session.group_id)
            raise

    def _save(self, session: Session) -> None:
        """After a call, finish or expiry that left the session open: its snapshot, once its chunks are acked."""
        if self.handoff is not None and session.phase == "open":
            self.handoff.save(session, list(self._acks.get(session.session_id, {}).values()))

    def _request(
        self, plan: TurnPlan, window: int, ids: CallIds, budget: int, sampling: Sampling
    ) -> GenerationRequest:
        """The generation of this turn on an engine with context ``window``; 400 when the prompt fills it."""
        if window - len(plan.prompt_ids) < 1:
            raise ContextOverflow(
                f"prompt of {len(plan.prompt_ids)} tokens leaves no room in the context window of {window}",
                phase="prompt", context_window=window, input_tokens=len(plan.prompt_ids), max_tokens=budget,
                session_id=ids.session_id, turn_id=ids.turn_id, segment_index=plan.segment_index,
            )
        return GenerationRequest(
            session_id=ids.session_id, prompt_ids=plan.prompt_ids, context_ids=plan.context_ids,
            budget=budget, window=window, sampling=sampling, partial_rollout=self.settings.partial_rollout,
            max_chunks=self.settings.max_chunks_per_call,
            stop_ids=() if sampling.ignore_eos else self._stop_ids,  # ignore_eos: run to the budget
        )

    async def _on_chunk(self, session: Session, engine: EngineHandle, plan: TurnPlan, outcome: ChunkOutcome) -> None:
        """A chunk came back: submit what the session says (not waiting for the ack), then
        tell it the chunk is sent. Its engine request is released once this returns."""
        self.metrics.tokens.inc(len(outcome.output.output_ids))
        if outcome.output.finish_reason == "abort":
            self.metrics.preempts.inc()
        for record in session.chunk(outcome, engine.url):
            assert isinstance(record, Chunk)
            ack = await self.publisher.submit(self.settings.topics.chunks, record)
            self._acks.setdefault(session.session_id, {})[record.seq] = ack
        rejection = session.chunk_sent()
        if plan.new_segment and outcome.chunk_index == 0:  # the segment exists from its first chunk on
            self._segment_opened(session, plan)
        elif plan.kept_rewrite and outcome.chunk_index == 0:
            self.metrics.kept_rewrites.inc()
        _raise(rejection)

    def _segment_opened(self, session: Session, plan: TurnPlan) -> None:
        """Count a new segment by reason; log the ones that re-tokenized a history (not a session's first)."""
        reason = plan.reason or "first"
        self.metrics.new_segments.labels(reason=reason).inc()
        if reason != "first":
            _log.info("new_segment", session_id=session.session_id, group_id=session.group_id, reason=reason,
                      segment_index=plan.segment_index, context_tokens=len(plan.context_ids))

    def _look(self, session: Session) -> None:
        """Feed the session every chunk Kafka refused so far; forget the answered acks."""
        acks = self._acks.get(session.session_id)
        if not acks:
            return
        for seq in sorted(acks):
            ack = acks[seq]
            if ack.done():
                del acks[seq]
                error = ack.exception()
                if error is not None:
                    session.chunk_lost(seq, _as_kafka_error(error))

    async def _settle(self, session: Session) -> None:
        """Wait (bounded) until every chunk the session submitted is answered, then feed the refusals."""
        acks = self._acks.get(session.session_id)
        if acks:
            await asyncio.wait(list(acks.values()), timeout=self._ack_bound_s)
        self._look(session)
        for seq in sorted(self._acks.get(session.session_id, {})):
            session.chunk_lost(seq, KafkaUnavailable(f"no answer from Kafka within {self._ack_bound_s:g}s"))

    async def _carry_out(self, session: Session, step: Step) -> None:
        """A step that may end the session: end it (whatever Kafka says), then publish."""
        self._end(session, step)
        try:
            await self._publish(step.publish)
        except KafkaUnavailable as exc:
            if step.required:
                raise  # the agent must not get a soft 200 when the rejection is not on record
            _log.error("session_rejected_not_published", session_id=session.session_id, error=str(exc))

    def _end(self, session: Session, step: Step) -> None:
        """Drop an ended session (its id is remembered) and count a rejection."""
        if step.ended is None:
            return
        self._acks.pop(session.session_id, None)
        self.engines.release(session)
        self.sessions.finalize(session, step.ended)
        if self.handoff is not None:
            self.handoff.ended(session.session_id, step.ended)
        if step.rejection is not None:
            error = step.rejection
            self.metrics.rejections.labels(error=error.code, soft=str(step.soft).lower()).inc()
            _log.warning("session_rejected", session_id=session.session_id, group_id=session.group_id,
                         error=error.code, soft=step.soft, num_chunks=session.written)

    async def _publish(self, records: Sequence[Record]) -> None:
        """Write each record and wait for its ack; ``kafka_unavailable`` is raised (the publisher counts it)."""
        for record in records:
            await self.publisher.send(getattr(self.settings.topics, record.topic_attr), record)

    # ------------------------------------------------------------------ finish

    async def finish(self, session_id: str, reward: float, status: str, error: str = "") -> dict[str, Any]:
        """Once every chunk of the session is acked, publish SessionFinished, then end the session;
        a Kafka failure of that record leaves it open (finish again). A chunk Kafka refused rejects
        the session instead (best effort on record, 503 ``kafka_unavailable``). While this waits the
        session is busy: a call or another finish gets 409.

        A session this proxy does not hold is 404, even named by its key: it never called here, or it
        called a proxy that restarted or a replica the balancer no longer routes to. Its chunks may be on
        Kafka, so no end is recorded that would claim a count this proxy does not know; the runner ends
        such a session as lost (its group is retried). With the handoff, a session another replica held is
        taken over here first."""
        await self._take_over(session_id)
        session = self.sessions.get(session_id)
        if session.busy:
            raise SessionBusy(f"session {session_id} has a call in flight; finish it after", session_id=session_id)
        session.busy = True
        try:
            await self._mark_call(session)
            await self._settle(session)
            step = session.finish(reward, status, error)
            if step.ended is not None:  # a chunk was lost: rejected
                await self._carry_out(session, step)
                assert step.error is not None
                raise step.error
            await self._publish(step.publish)
            self._end(session, session.end_acked())
        finally:
            session.busy = False
            self.metrics.sessions.set(len(self.sessions))
            self._save(session)
        return {"session_id": session_id, "status": status, "reward": reward,
                "num_chunks": session.num_chunks, "published": bool(step.publish)}

    # ------------------------------------------------------------------ idle sessions

    async def expire_idle(self) -> int:
        """Reject every session idle past ``session_idle_timeout_s``; returns how many.

        The rejection is published after the session's chunks are answered (so it counts
        those on Kafka), and is on Kafka before the session is dropped: when Kafka refuses
        one, it and the rest stay live and are tried again at the next sweep. Meanwhile the
        session is busy, so a late call or finish gets 409 instead of racing it.
        """
        timeout = self.settings.session_idle_timeout_s
        if not timeout:
            return 0
        expired = 0
        for session in self.sessions.idle(timeout):
            if session.busy or session.phase != "open":  # taken or ended while an earlier one was published
                continue
            session.busy = True  # a late call or finish gets 409 while the rejection is being published
            try:
                await self._mark_call(session)  # a copy left behind by a takeover is dropped, not expired
                await self._settle(session)
                await self._publish(session.expire(timeout).publish)
            except SessionMoved:
                continue
            except KafkaUnavailable as exc:
                _log.warning("idle_session_not_expired", session_id=session.session_id, error=str(exc))
                self._save(session)
                break  # Kafka is down: the rest wait for the next sweep instead of a send timeout each
            finally:
                session.busy = False
            self._end(session, session.end_acked())
            expired += 1
        if expired:
            self.metrics.sessions.set(len(self.sessions))
        return expired

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
                         "requests": e.requests, **self.engines.standing(e.url)} for e in self.engines.all()],
            "time": time.time(),
        }


def _as_kafka_error(error: BaseException) -> KafkaUnavailable:
    return error if isinstance(error, KafkaUnavailable) else KafkaUnavailable(f"{type(error).__name__}: {error}")


def _raise(error: BaseException | None) -> None:
    """Raise what a session event answered, if anything: it stops the generation."""
    if error is not None:
        raise error
