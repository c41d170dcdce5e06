"""A session's tokens, kept token-in-token-out (TITO): pure bookkeeping, no I/O.

A session's tokens are cut into *segments*; a segment is one growing token sequence,
the unit the collector turns into a training sample. A call whose messages extend
the messages recorded for the current segment (the assistant message this proxy
returned included, compared by their rendered token ids) appends only the new
messages' tokens and the assistant header: the engine sees exactly the ids it
sampled earlier, never a re-tokenisation of its own text. Any other call (a
rewritten or truncated history) starts a new segment rendered from the full chat
template. A segment whose call failed after a chunk publish was tried is closed
(that record may or may not be on Kafka), so the next call starts a new one.

Every tokenisation goes through :meth:`Transcript.plan` and the injected
:class:`ChatTokenizer`; a model family's chat template (issue 14) changes only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shared.versions import distinct_real

Rendered = tuple[int, ...]
"""One chat message rendered to token ids (role token, content, end token)."""


class ChatTokenizer(Protocol):
    """What a session needs of the model family's tokenizer and chat template."""

    @property
    def end_id(self) -> int: ...

    @property
    def assistant_id(self) -> int: ...

    def render_message(self, role: str, content: str) -> list[int]:
        """One message's ids; ValueError for a role the template does not know."""
        ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


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


class Transcript:
    """The segments of one session and the chunks recorded into them (a mixin: the session
    dataclass declares the two fields)."""

    segments: list[SegmentState]
    num_chunks: int
    """Chunk records published for this session (the next chunk's ``seq``)."""

    @property
    def current(self) -> SegmentState | None:
        return self.segments[-1] if self.segments else None

    def versions(self) -> list[str]:
        """Distinct real versions of every output token of every segment, in first-seen order."""
        return distinct_real(v for seg in self.segments for v in seg.versions)

    def plan(self, messages: Sequence[tuple[str, str]], tokenizer: ChatTokenizer) -> TurnPlan:
        """How the call with ``messages`` extends the session (TITO) or starts a new segment.

        Raises ValueError for a role the chat template does not know.
        """
        rendered = tuple(tuple(tokenizer.render_message(role, content)) for role, content in messages)
        seg = self.current
        if seg is not None and seg.open and seg.messages and _extends(rendered, seg.messages):
            context: list[int] = []
            if seg.token_ids and seg.token_ids[-1] != tokenizer.end_id:
                # The last output was cut by its budget before <|end|>: close that message
                # the way the template would, so the new messages start on a boundary.
                context.append(tokenizer.end_id)
            for message in rendered[len(seg.messages) :]:
                context.extend(message)
            context.append(tokenizer.assistant_id)
            return TurnPlan(segment_index=seg.index, new_segment=False, context_ids=tuple(context),
                            prompt_ids=(*seg.token_ids, *context), messages=rendered)
        template = (*(tok for message in rendered for tok in message), tokenizer.assistant_id)
        index = 0 if seg is None else seg.index + 1
        return TurnPlan(segment_index=index, new_segment=True, context_ids=template, prompt_ids=template,
                        messages=rendered)

    def record_chunk(
        self, plan: TurnPlan, context_ids: Sequence[int], output_ids: Sequence[int], versions: Sequence[str | None],
    ) -> int:
        """Apply one published chunk (``versions``: one normalised label per output token) and return its ``seq``.

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
        seg.token_ids.extend([*context_ids, *output_ids])
        seg.versions.extend([*([None] * len(context_ids)), *versions])
        self.num_chunks += 1
        return self.num_chunks - 1

    def complete_turn(self, plan: TurnPlan, assistant: Rendered) -> None:
        """The call succeeded: its messages plus the returned assistant message are the segment's history."""
        seg = self.current
        if seg is None or seg.index != plan.segment_index:
            raise RuntimeError("complete_turn without a recorded chunk")
        seg.messages = [*plan.messages, assistant]

    def close_segment(self, plan: TurnPlan) -> None:
        """A chunk publish of this segment failed or was lost: no later call may extend it."""
        seg = self.current
        if seg is not None and seg.index == plan.segment_index:
            seg.open = False


def _extends(messages: Sequence[Rendered], recorded: Sequence[Rendered]) -> bool:
    return len(messages) >= len(recorded) and tuple(messages[: len(recorded)]) == tuple(recorded)
