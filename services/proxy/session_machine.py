"""One session as a pure state machine: events in, what to publish and answer out.

A session is one agent conversation (``X-Session-Id``). Its tokens are cut into
*segments*; a segment is one growing token sequence, the unit the collector turns
into a training sample. No I/O, no asyncio here: :mod:`services.proxy.service` feeds
the events in the order they happen and does what each answer says (publish these
records, end the session, answer the agent).

Lifecycle::

    open ──begin──▶ in call ──complete──▶ open ──finish, end_acked──▶ finished
                       │ └──fail (nothing published in this call)──▶ open
                       └──fail (a staleness rule; anything once this call published;
                                the engine holding its tokens lost)──▶ rejected
    open ──expire, end_acked──▶ rejected (session_idle)
    open, a chunk lost ──begin refused, fail | finish──▶ rejected (kafka_unavailable)

Chunks are submitted, not awaited: the shell feeds ``chunk_sent`` once a chunk's records
are queued, and ``chunk_lost`` when it learns that Kafka refused one (at the session's next
call, finish, expiry or rejection, after waiting for the acks where the end needs them).
A session with a lost chunk can never be whole on Kafka, so it takes no more calls and
cannot finish; every rejection counts only the chunks before the first lost one.

Events and what they return:

================  ==================================================================
``begin``         turn planned: the :class:`TurnPlan` (a new segment's says why; 422 for messages the template
                  cannot render; 503 ``kafka_unavailable`` once a chunk was lost: the shell feeds it to ``fail``)
``check_engine``  before each engine call: the rejection the engine's version would cause
``chunk``         chunk received: the records to submit (none untracked)
``chunk_sent``    the chunk's records are submitted (acks may come later): recorded; the rejection it causes
``chunk_lost``    Kafka refused chunk ``seq``: recorded; the session can no longer finish
``complete``      the call's generation ended: the :class:`ChatOutcome` to answer
``fail``          reject, preempt without partial rollout, engine lost, Kafka refused: a :class:`Step`
``cancel``        the call was cancelled (no awaiting): a :class:`Step` with nothing to publish
``finish``        the agent's finish, every chunk answered: the SessionFinished to publish, the session
                  ends at ``end_acked``; with a lost chunk the ``kafka_unavailable`` rejection instead
``expire``        idle too long, every chunk answered: the SessionRejected to publish; ends at ``end_acked``
================  ==================================================================

Tokens are kept token-in-token-out by :class:`~services.proxy.transcript.Transcript`;
tokenisation happens only there and in :meth:`Session.complete` (decoding the answer), through
the model family's :class:`~shared.model.base.ChatTokenizer` the shell injects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from services.proxy.replies import ChatOutcome, ForceCall, ToolCalls, read_reply
from services.proxy.transcript import (
    Answer,
    NewSegmentReason,
    RewrittenHistory,
    SegmentState,
    Transcript,
    TurnPlan,
)
from shared.errors import (
    EngineLost,
    InvalidRequest,
    KafkaUnavailable,
    PartialRolloutStalenessExceeded,
    ReinError,
    RolloutRejected,
    SessionBusy,
    SessionFinalized,
    SessionIdle,
    TrajectoryVersionChanged,
    UnsupportedParameter,
)
from shared.model.chat import ChatTokenizer, Messages, Tools
from shared.model.tiny_chat import TinyChatTokenizer
from shared.model.tool_calls import ToolCallFormat
from shared.schemas import Chunk, Record, SessionFinished, SessionRejected
from shared.span_cap import check_span
from shared.versions import distinct_real, encode_runs

if TYPE_CHECKING:
    from services.proxy.generation import ChunkOutcome, Generation

__all__ = ["NewSegmentReason", "SegmentState", "Session", "Step", "TurnPlan", "VersionRules"]


@dataclass(frozen=True)
class VersionRules:
    """The proxy's staleness settings, as the session applies them."""

    partial_rollout: bool = True
    max_preempts: int | None = None
    """Span cap with partial rollout (``None``: no cap)."""


@dataclass(frozen=True)
class Step:
    """What the shell does after an event, in this order: end the session when ``ended``
    says so, publish ``publish``, then answer ``answer`` or raise ``error``.

    Records are data, so the shell decides how to wait for them: chunks are submitted
    without waiting (``chunk_sent``, failures fed back as ``chunk_lost``); an end record is
    awaited (``end_acked``; a required rejection's failure replaces the answer)."""

    publish: tuple[Record, ...] = ()
    required: bool = True
    """A failed publish replaces the answer with ``kafka_unavailable``; else it is only logged."""
    ended: str | None = None
    """The session's outcome when this step ends it (``finished``, ``rejected (code)``)."""
    rejection: ReinError | None = None
    """Why the session was rejected (for metrics and logs)."""
    soft: bool = False
    answer: ChatOutcome | None = None
    error: BaseException | None = None


Phase = Literal["open", "in_call", "finished", "rejected"]


@dataclass
class Session(Transcript):
    """One conversation. Fed only by the request handler that holds ``busy``."""

    session_id: str
    group_id: str
    prompt_id: str = ""
    attempt: int = 0
    tokenizer: ChatTokenizer = field(default_factory=TinyChatTokenizer, repr=False, compare=False)
    """The served model family's (the service passes it; the default serves tests of the machine alone)."""
    rules: VersionRules = field(default_factory=VersionRules)
    tool_calls: ToolCallFormat = ToolCallFormat.NONE
    """How replies are parsed into tool calls (the proxy's ``REIN_TOOL_CALL_PARSER``, or the model's)."""
    rewritten_history: RewrittenHistory = "keep"
    """What a call gets when the chat template rewrote the earlier turns (``REIN_REWRITTEN_HISTORY``)."""
    segments: list[SegmentState] = field(default_factory=list)
    num_chunks: int = 0
    """Chunk records submitted for this session (the next chunk's ``seq``)."""
    lost: int | None = None
    """``seq`` of the first chunk Kafka refused: the session can never be whole; a rejection counts
    the chunks before it."""
    phase: Phase = "open"
    busy: bool = False
    """Held by a request (a call, or publishing the idle rejection): others get 409. Set by the store."""
    last_active: float = 0.0
    """Clock reading of the last time a call started or ended (the idle timeout counts from it)."""
    engine: str = ""
    """The engine the session sticks to ("" before its first call); the proxy's routing sets it."""
    _turn: TurnPlan | None = field(default=None, init=False, repr=False)
    _turn_id: str = field(default="", init=False, repr=False)
    _first_seq: int = field(default=0, init=False, repr=False)
    """``num_chunks`` when the current call began: more means this call published."""
    _pending: ChunkOutcome | None = field(default=None, init=False, repr=False)
    _ending: Step | None = field(default=None, init=False, repr=False)
    _lost_error: KafkaUnavailable | None = field(default=None, init=False, repr=False)

    @property
    def trainable(self) -> bool:
        """Sessions without a group id are served but never published for training."""
        return bool(self.group_id)

    # ------------------------------------------------------------------ events of a chat call

    @property
    def written(self) -> int:
        """Chunks a rejection counts: all submitted ones, or those before the first lost one."""
        return self.num_chunks if self.lost is None else self.lost

    def begin(self, messages: Messages, turn_id: str = "", tools: Tools = None, force: ForceCall | None = None
              ) -> TurnPlan:
        """Turn planned: the session is in a call until ``complete``, ``fail`` or ``cancel``.
        Refused (``kafka_unavailable``, to be fed to ``fail``) once a chunk was lost; 400 when ``force``
        asks for a call the served family cannot open."""
        self._require("open")
        if self._lost_error is not None:
            raise self._lost_error
        forced: list[int] = []
        if force is not None:
            opener = self.tokenizer.call_opener(self.tool_calls, force.name)
            if opener is None:
                why = f"the served model writes no tool calls the proxy parses ({self.tool_calls.value})"
                raise UnsupportedParameter(f"tool_choice: {why}", fields=[{"field": "tool_choice", "message": why}])
            forced = opener
        try:
            plan = self.plan(messages, self.tokenizer, tools, forced, self.rewritten_history)
        except ValueError as exc:  # UnrenderableMessages names the field
            field = getattr(exc, "field", "messages")
            raise InvalidRequest(str(exc), fields=[{"field": field, "message": str(exc)}]) from None
        self.phase, self._turn, self._turn_id, self._first_seq = "in_call", plan, turn_id, self.num_chunks
        return plan

    def check_engine(self, version: str | None) -> RolloutRejected | None:
        """Before an engine call: the rejection if the engine's current version would break a rule."""
        return self._rejection([version] if version is not None else [])

    def chunk(self, outcome: ChunkOutcome, engine: str) -> tuple[Record, ...]:
        """A chunk came back: the records to submit (none for an untracked session) before ``chunk_sent``."""
        plan = self._call()
        out = outcome.output
        record = None
        if self.trainable:
            record = Chunk(
                session_id=self.session_id, group_id=self.group_id, prompt_id=self.prompt_id, attempt=self.attempt,
                turn_id=self._turn_id, seq=self.num_chunks, segment_index=plan.segment_index,
                chunk_index=outcome.chunk_index, context_ids=list(outcome.context_ids), output_ids=list(out.output_ids),
                logprobs=list(out.logprobs), version=out.version, token_versions=encode_runs(out.token_versions),
                finish_reason=out.finish_reason, rid=out.rid, engine=engine,
                sampling=None if outcome.sampling is None else outcome.sampling.params(),
                forced_ids=list(plan.forced) if outcome.chunk_index == 0 else [],
            )
        self._pending = outcome
        return () if record is None else (record,)

    def chunk_sent(self) -> RolloutRejected | None:
        """The chunk's records are submitted, behind every earlier one: it joins the segment.
        Returns the rejection its versions cause, checked against what the session held *before* it."""
        plan = self._call()
        if self._pending is None:
            raise RuntimeError("chunk_sent without a chunk")
        outcome, self._pending = self._pending, None
        out = outcome.output
        rejection = self._rejection([out.version, *out.token_versions])
        self.record_chunk(plan, outcome.context_ids, out.output_ids, out.token_versions)
        return rejection

    def chunk_lost(self, seq: int, error: KafkaUnavailable) -> None:
        """Kafka refused chunk ``seq`` (learned whenever the shell next holds the session): the
        session's records can never be whole, so it takes no more calls and cannot finish."""
        if self.phase in ("finished", "rejected") or (self.lost is not None and self.lost <= seq):
            return
        self.lost = seq
        self._lost_error = KafkaUnavailable(
            f"chunk {seq} of session {self.session_id} could not be written to Kafka ({error.message}); "
            "the session is rejected", session_id=self.session_id, seq=seq,
        )

    def complete(self, gen: Generation, stop: Sequence[str] = (), calls: ToolCalls = "all") -> ChatOutcome:
        """The generation ended: the answer is the text of the sampled ids (a final stop id is no text),
        read by :func:`~services.proxy.replies.read_reply` (the request's ``stop`` strings, the thinking
        of a reasoning model, content and tool calls). ``calls``: ``none`` (``tool_choice: none``) answers
        the text as content, ``first`` (``parallel_tool_calls: false``) only the first call."""
        plan = self._call()
        text = self.tokenizer.decode([*plan.forced, *gen.output_ids])  # a forced opener is the reply's start
        reply = read_reply(text, gen.finish_reason, self.tokenizer.reasoning, self.tool_calls, stop, calls)
        self.answered(plan, Answer(reply.message, text))
        self._leave_call()
        rein = {
            "session_id": self.session_id, "engine": self.engine, "segment_index": plan.segment_index,
            "new_segment": plan.new_segment,
            "output_ids": gen.output_ids, "versions": gen.versions, "forced_ids": list(plan.forced),
            "chunks": [{"rid": c.output.rid, "version": c.output.version, "finish_reason": c.output.finish_reason,
                        "num_tokens": len(c.output.output_ids)} for c in gen.chunks],
        }
        return ChatOutcome(content=reply.content, finish_reason="tool_calls" if reply.tool_calls else gen.finish_reason,
                           prompt_tokens=len(plan.prompt_ids), completion_tokens=len(gen.output_ids), rein=rein,
                           tool_calls=reply.tool_calls, call_markup=reply.call_markup,
                           stop_sequence=reply.stop_sequence, reasoning=reply.reasoning)

    def fail(self, error: Exception, *, soft: bool = False) -> Step:
        """The call stopped on ``error``. A staleness rule rejects the session (softly when asked);
        any other failure rejects it only once this call published, a chunk of the session
        was lost, or the engine holding its tokens is (``EngineLost``): its records cannot be completed;
        the agent still gets ``error``.
        Otherwise the session stays open."""
        if self.phase == "open" and self._lost_error is not None:  # ``begin`` refused the call
            return replace(self._reject(self._lost_error, soft=False, required=False), error=error)
        if self.phase != "in_call":
            return Step(error=error)
        if isinstance(error, RolloutRejected):
            return self._reject(error, soft=soft, required=True)
        if isinstance(error, EngineLost) and self.num_chunks > 0:
            return self._reject(error, soft=False, required=False)  # its tokens' engine is gone: never whole
        plan, published = self._call(), self.num_chunks > self._first_seq
        if published or (isinstance(error, KafkaUnavailable) and self._pending is not None):
            self.close_segment(plan)
        if self._lost_error is not None:
            return replace(self._reject(self._lost_error, soft=False, required=False), error=error)
        if not published:
            self._leave_call()
            return Step(error=error)
        rejection = error if isinstance(error, ReinError) else ReinError(f"{type(error).__name__}: {error}")
        return replace(self._reject(rejection, soft=False, required=False), error=error)

    def cancel(self) -> Step:
        """The call was cancelled (shutdown): once it published, the session takes no more calls."""
        if self.phase != "in_call":
            return Step()
        if self.num_chunks == self._first_seq:
            self._leave_call()
            return Step()
        self.close_segment(self._call())
        self._pending, self.phase = None, "rejected"
        return Step(ended="rejected (cancelled)")

    # ------------------------------------------------------------------ events that end an open session

    def finish(self, reward: float, status: str, error: str = "") -> Step:
        """The agent reports its reward, every chunk answered: publish SessionFinished (tracked
        sessions); the session ends at ``end_acked``, and stays open if the publish fails. With
        a lost chunk the session is rejected instead (``kafka_unavailable``, at once)."""
        self._require("open")
        if self._lost_error is not None:
            return self._reject(self._lost_error, soft=False, required=False)
        self._ending = Step(ended="finished")
        if not self.trainable:
            return Step()
        record = SessionFinished(
            session_id=self.session_id, group_id=self.group_id, reward=reward, status=status,  # type: ignore[arg-type]
            num_chunks=self.num_chunks, error=error if status == "failed" else "",
        )
        return Step(publish=(record,))

    def expire(self, timeout_s: float) -> Step:
        """No call for ``timeout_s``, every chunk answered: publish SessionRejected; the session ends
        at ``end_acked``."""
        self._require("open")
        error = SessionIdle(f"session {self.session_id} had no call for {timeout_s:g}s", session_id=self.session_id,
                            idle_timeout_s=timeout_s)
        self._ending = Step(ended=f"rejected ({error.code})", rejection=error)
        return Step(publish=self._rejected_record(error), rejection=error)

    def end_acked(self) -> Step:
        """The records of ``finish`` or ``expire`` are on Kafka: the session ends."""
        self._require("open")
        if self._ending is None:
            raise RuntimeError("end_acked without finish or expire")
        step, self._ending = self._ending, None
        self.phase = "finished" if step.ended == "finished" else "rejected"
        return step

    # ------------------------------------------------------------------ internals

    def _require(self, phase: Phase) -> None:
        """Refuse an event the phase does not take: 409 for the agent's, RuntimeError for the shell's."""
        if self.phase == phase:
            return
        if self.phase in ("finished", "rejected"):
            raise SessionFinalized(f"session {self.session_id} is {self.phase}; it takes no more calls",
                                   session_id=self.session_id, outcome=self.phase)
        if self.phase == "in_call":
            raise SessionBusy(f"session {self.session_id} has a call in flight", session_id=self.session_id)
        raise RuntimeError(f"session {self.session_id} is {self.phase}, not {phase}")

    def _call(self) -> TurnPlan:
        self._require("in_call")
        assert self._turn is not None
        return self._turn

    def _leave_call(self) -> None:
        self.phase, self._turn, self._pending = "open", None, None

    def _reject(self, error: ReinError, *, soft: bool, required: bool) -> Step:
        self.phase, self._turn, self._pending = "rejected", None, None
        answer = None
        if soft:
            answer = ChatOutcome(content="", finish_reason="stop", prompt_tokens=0, completion_tokens=0,
                                 rein={"session_id": self.session_id, "rejected": error.detail()}, soft_rejected=True)
        return Step(publish=self._rejected_record(error), required=required, ended=f"rejected ({error.code})",
                    rejection=error, soft=soft, answer=answer, error=None if soft else error)

    def _rejected_record(self, error: ReinError) -> tuple[Record, ...]:
        if not self.trainable:
            return ()
        return (SessionRejected(session_id=self.session_id, group_id=self.group_id, error=error.code,
                                detail=_jsonable(error.detail()), num_chunks=self.written),)

    def _rejection(self, candidates: Sequence[str | None]) -> RolloutRejected | None:
        """The staleness rule the session breaks if it took tokens of ``candidates``, if any."""
        recorded = self.versions()
        if self.rules.partial_rollout:
            span = check_span(recorded, candidates, self.rules.max_preempts, self.session_id)
            return None if span is None else PartialRolloutStalenessExceeded.from_detail(span.detail())
        new = [v for v in distinct_real(candidates) if v not in recorded]
        if not (recorded and new):
            return None
        return TrajectoryVersionChanged(
            f"session {self.session_id} was generated with {recorded}; the engine now serves {new} "
            "and partial rollout is off",
            previous_versions=recorded, new_versions=new, session_id=self.session_id,
        )


def _jsonable(value: Any) -> Any:
    """Detail fields made msgpack/JSON safe (tuples to lists, unknown objects to strings)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
