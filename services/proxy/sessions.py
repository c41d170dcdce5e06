"""The session store: pure bookkeeping of every live session, no I/O.

A session is one agent conversation (``X-Session-Id``). Its tokens are cut into
*segments*; a segment is one growing token sequence, the unit the collector turns
into a training sample.

Token-in-token-out (TITO). A call whose messages extend the messages recorded for
the current segment (the assistant message this proxy returned included, compared
by their rendered token ids) appends only the new messages' tokens and the
assistant header to the segment: the engine sees exactly the token ids it produced
earlier, never a re-tokenisation of its own text. Any other call (a rewritten or
truncated history) starts a new segment rendered from the full chat template. A
segment whose call failed after some of its chunks were published is closed, so
the next call starts a new segment too (the records on Kafka stay consistent).

Lifecycle::

    open ──(chat calls)──▶ finished   (POST /v1/sessions/{id}/finish)
                       └─▶ rejected   (a staleness rule, or a failure after publishing)

Finished and rejected sessions drop their data; their ids are remembered (bounded)
so later calls get 409 instead of silently starting a new session. A session with no
call for the idle timeout is rejected too (``session_idle``): its agent is gone (a
crashed rollout runner, an agent that never calls finish), and without an end record
its group would hold the collector until its incomplete timeout and never be retried.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.errors import BadRequest, SessionBusy, SessionFinalized, SessionNotFound
from shared.tokenizer import Tokenizer
from shared.versions import distinct_real

Rendered = tuple[int, ...]
"""One chat message rendered to token ids (role token, content, end token)."""


@dataclass
class SegmentState:
    """One segment: every token id in order, with the version of each output token."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    """One entry per token: the normalised version for output tokens, None for context tokens."""
    messages: list[Rendered] = field(default_factory=list)
    """The messages this segment's tokens stand for, as last confirmed by a completed call."""
    open: bool = True
    """False once a call failed after publishing: the next call starts a new segment."""


@dataclass(frozen=True)
class TurnPlan:
    """What one chat call will add: computed before generating, applied by the first chunk."""

    segment_index: int
    new_segment: bool
    context_ids: tuple[int, ...]
    """Tokens appended before the output (new messages + assistant header; the full
    template for a new segment). This is the first chunk's ``context_ids``."""
    prompt_ids: tuple[int, ...]
    """The whole input of the first engine call: the segment so far plus ``context_ids``."""
    messages: tuple[Rendered, ...]
    """The call's messages, rendered (recorded when the call completes)."""


@dataclass
class Session:
    """One conversation. Mutated only by the request handler that holds ``busy``."""

    session_id: str
    group_id: str
    prompt_id: str = ""
    attempt: int = 0
    segments: list[SegmentState] = field(default_factory=list)
    num_chunks: int = 0
    """Chunk records published for this session (the next chunk's ``seq``)."""
    busy: bool = False
    last_active: float = 0.0
    """Clock reading of the last time a call started or ended (the idle timeout counts from it)."""

    @property
    def trainable(self) -> bool:
        """Sessions without a group id are served but never published for training."""
        return bool(self.group_id)

    @property
    def current(self) -> SegmentState | None:
        return self.segments[-1] if self.segments else None

    def versions(self) -> list[str]:
        """Distinct real versions of every output token of every segment, in first-seen order."""
        return distinct_real(v for seg in self.segments for v in seg.versions)

    def plan(self, messages: Sequence[tuple[str, str]], tokenizer: Tokenizer) -> TurnPlan:
        """How the call with ``messages`` extends the session (TITO) or starts a new segment.

        Raises ValueError for a role the chat template does not know.
        """
        rendered = tuple(tuple(tokenizer.render_message(role, content)) for role, content in messages)
        seg = self.current
        if seg is not None and seg.open and seg.messages and _extends(rendered, seg.messages):
            new = rendered[len(seg.messages) :]
            context: list[int] = []
            if seg.token_ids and seg.token_ids[-1] != tokenizer.end_id:
                # The last output was cut by its budget before <|end|>: close that message
                # the way the template would, so the new messages start on a boundary.
                context.append(tokenizer.end_id)
            for message in new:
                context.extend(message)
            context.append(tokenizer.assistant_id)
            return TurnPlan(
                segment_index=seg.index,
                new_segment=False,
                context_ids=tuple(context),
                prompt_ids=(*seg.token_ids, *context),
                messages=rendered,
            )
        template = [tok for message in rendered for tok in message]
        template.append(tokenizer.assistant_id)
        index = 0 if seg is None else seg.index + 1
        return TurnPlan(
            segment_index=index, new_segment=True, context_ids=tuple(template), prompt_ids=tuple(template),
            messages=rendered,
        )

    def record_chunk(
        self, plan: TurnPlan, context_ids: Sequence[int], output_ids: Sequence[int],
        versions: Sequence[str | None],
    ) -> int:
        """Apply one published chunk (``versions``: one normalised label per output token) to the
        segment and return its ``seq``.

        The first chunk of a new-segment plan opens the segment, so a call that fails
        before its first chunk leaves the session untouched.
        """
        seg = self.current
        if plan.new_segment and (seg is None or seg.index != plan.segment_index):
            seg = SegmentState(index=plan.segment_index)
            self.segments.append(seg)
        if seg is None or seg.index != plan.segment_index:
            raise RuntimeError(f"chunk for segment {plan.segment_index} but the session is at {seg}")
        if len(versions) != len(output_ids):
            raise ValueError(f"{len(versions)} versions for {len(output_ids)} output tokens")
        seg.token_ids.extend(context_ids)
        seg.versions.extend([None] * len(context_ids))
        seg.token_ids.extend(output_ids)
        seg.versions.extend(versions)
        seq = self.num_chunks
        self.num_chunks += 1
        return seq

    def complete_turn(self, plan: TurnPlan, assistant: Rendered) -> None:
        """The call succeeded: its messages plus the returned assistant message are the segment's history."""
        seg = self.current
        if seg is None or seg.index != plan.segment_index:
            raise RuntimeError("complete_turn without a recorded chunk")
        seg.messages = [*plan.messages, assistant]

    def close_segment(self, plan: TurnPlan) -> None:
        """The call failed after publishing some chunks: no later call may extend this segment."""
        seg = self.current
        if seg is not None and seg.index == plan.segment_index:
            seg.open = False


def _extends(messages: Sequence[Rendered], recorded: Sequence[Rendered]) -> bool:
    return len(messages) >= len(recorded) and tuple(messages[: len(recorded)]) == tuple(recorded)


class SessionStore:
    """Live sessions by id, plus a bounded memory of finalized ids (for 409)."""

    def __init__(self, finalized_memory: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._live: dict[str, Session] = {}
        self._final: OrderedDict[str, str] = OrderedDict()
        self._memory = finalized_memory
        self._clock = clock

    def __len__(self) -> int:
        return len(self._live)

    def acquire(self, session_id: str, group_id: str, prompt_id: str = "", attempt: int = 0) -> Session:
        """The session for a chat call, created on first use, marked busy.

        409 when finalized or already in a call; 400 when the group id differs from
        the one the session started with.
        """
        self._raise_if_final(session_id)
        session = self._live.get(session_id)
        if session is None:
            session = Session(session_id=session_id, group_id=group_id, prompt_id=prompt_id, attempt=attempt)
            self._live[session_id] = session
        elif session.group_id != group_id:
            raise BadRequest(
                f"session {session_id} belongs to group {session.group_id!r}, not {group_id!r}",
                session_id=session_id, group_id=session.group_id, got=group_id,
            )
        if session.busy:
            raise SessionBusy(f"session {session_id} already has a call in flight", session_id=session_id)
        session.busy = True
        session.last_active = self._clock()
        return session

    def release(self, session: Session) -> None:
        session.busy = False
        session.last_active = self._clock()

    def idle(self, timeout_s: float) -> list[Session]:
        """Live sessions with no call in flight and none started or ended for ``timeout_s``, oldest first."""
        cutoff = self._clock() - timeout_s
        stale = [s for s in self._live.values() if not s.busy and s.last_active <= cutoff]
        return sorted(stale, key=lambda s: s.last_active)

    def get(self, session_id: str) -> Session:
        """A live session; 409 when finalized, 404 when never seen."""
        self._raise_if_final(session_id)
        session = self._live.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id} on this proxy", session_id=session_id)
        return session

    def finalize(self, session: Session, outcome: str) -> None:
        """Drop the session's data; later calls with its id get 409 naming ``outcome``."""
        self._live.pop(session.session_id, None)
        self._final[session.session_id] = outcome
        self._final.move_to_end(session.session_id)
        while len(self._final) > self._memory:
            self._final.popitem(last=False)

    def outcome(self, session_id: str) -> str | None:
        return self._final.get(session_id)

    def _raise_if_final(self, session_id: str) -> None:
        outcome = self._final.get(session_id)
        if outcome is not None:
            raise SessionFinalized(
                f"session {session_id} is {outcome}; it takes no more calls", session_id=session_id, outcome=outcome
            )
