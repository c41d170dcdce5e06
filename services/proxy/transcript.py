"""A session's tokens, kept token-in-token-out (TITO): pure bookkeeping, no I/O.

A session's tokens are cut into *segments*; a segment is one growing token sequence,
the unit the collector turns into a training sample. A call whose messages extend what
the current segment stands for (its rendered messages and the assistant answers this
proxy returned) appends only the chat template's delta: the engine sees exactly the ids
it sampled earlier, never a re-tokenisation of its own text. Any other call (a rewritten
or truncated history) starts a new segment rendered from the full chat template. A
segment whose call failed after a chunk publish was tried is closed (that record may or
may not be on Kafka), so the next call starts a new one.

An answer with tool calls reaches the agent parsed (content and ``tool_calls``), and comes back
parsed, perhaps with the arguments re-serialized: a message that echoes an answer of the segment
(:meth:`Answer.echoed_by`) stands for the text that was sampled when the segment is continued,
so the engine sees its own call text again, not the template's rendering of the parsed call.

A chat template that rewrites history (Qwen3's drops earlier turns' thinking once a new user message
arrives) cannot be continued that way: what it renders for the earlier turns is no longer what the engine
saw. :data:`RewrittenHistory` says what happens then: ``keep`` the session one segment (the engine is given
its own earlier ids verbatim and each new message's delta as the template renders it after them), or
``follow`` the template (a new segment, ``template_mismatch``, its prompt the template's rewritten history).

A new segment re-tokenizes the whole history, so each one carries a
:data:`NewSegmentReason` (:func:`new_segment_reason`) that the proxy counts: an agent that
keeps editing its history shows up there instead of silently losing token exactness.

Every tokenisation goes through :meth:`Transcript.plan` and the model family's
:class:`~shared.model.base.ChatTokenizer` (``encode_chat``, ``continue_chat``), which
alone knows the template: nothing here depends on which family is served.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from shared.model.chat import Messages, Tools
from shared.versions import distinct_real

if TYPE_CHECKING:
    from shared.model.chat import ChatTokenizer

RewrittenHistory = Literal["keep", "follow"]
"""What a call does when the chat template renders the session's earlier turns otherwise than the engine
saw them (every other check of :func:`new_segment_reason` passed): ``keep`` the segment, or ``follow`` the
template into a new one (docs/agents.md, "Templates that rewrite history")."""

NewSegmentReason = Literal[
    "first", "publish_failed", "tools_changed", "history_diverged", "assistant_dropped", "assistant_edited",
    "template_mismatch",
]
"""Why a call starts a new segment; every reason but ``first`` is a call that could not continue token-exact."""


@dataclass(frozen=True)
class Call:
    """A call's tools and messages as the agent sent them, kept by reference (nothing is computed per call)
    and compared only when a later call cannot continue the segment, to say why."""

    tools: tuple[Mapping[str, Any], ...] = ()
    messages: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def of(cls, messages: Messages, tools: Tools = None) -> Call:
        return cls(tools=tuple(tools or ()), messages=tuple(messages))


@dataclass(frozen=True)
class Answer:
    """What one call answered: the assistant message the agent got, and the text of the ids sampled."""

    message: Mapping[str, Any]
    """``{"role": "assistant", "content": ..., "tool_calls": [...]}`` as the response carried it."""
    text: str
    """The sampled ids' text (:meth:`ChatTokenizer.decode`): what ``continue_chat`` compares the turn to."""

    def echoed_by(self, message: Mapping[str, Any]) -> bool:
        """Whether ``message`` is this answer sent back: an assistant message with the same content (None
        is empty) and the same calls, by name and arguments (as JSON values: re-serialized is the same). Its
        thinking (``reasoning_content``) may be left out, as most clients do; sent back, it is the same."""
        thinking = message.get("reasoning_content")
        return (
            message.get("role") == "assistant"
            and (message.get("content") or "") == (self.message.get("content") or "")
            and _calls_key(message.get("tool_calls")) == _calls_key(self.message.get("tool_calls"))
            and (thinking is None or thinking == self.message.get("reasoning_content"))
        )


def _calls_key(calls: Any) -> tuple[tuple[str, str], ...]:
    """Tool calls as ``(name, canonical arguments)``: ids and JSON spacing play no part."""
    out = []
    for call in calls or ():
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        args = function.get("arguments", "")
        try:
            value = json.loads(args) if isinstance(args, str) else args
            canonical = json.dumps(value, sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError):
            canonical = str(args)
        out.append((str(function.get("name", "")), canonical))
    return tuple(out)


def as_sampled(messages: Messages, answers: Sequence[Answer]) -> list[Mapping[str, Any]]:
    """``messages`` with each echo of ``answers`` (in order) replaced by an assistant message whose
    content is the text sampled: what the segment's turns stand for."""
    out: list[Mapping[str, Any]] = []
    pending = iter(answers)
    nxt = next(pending, None)
    for message in messages:
        if nxt is not None and nxt.echoed_by(message):
            out.append({"role": "assistant", "content": nxt.text})
            nxt = next(pending, None)
        else:
            out.append(message)
    return out


@dataclass
class SegmentState:
    """One segment: every token id in order, with the version of each output token."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    """One entry per token: the normalised version for output tokens, None for context tokens."""
    turns: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """The same ids cut by call: (context ids, every id sampled in that call's chunks). Ids the proxy forced
    after the generation prompt (a call's opener, ``tool_choice``) count with the sampled ones here: they are
    the assistant's text the answer stands for (their records keep them as context, never trained)."""
    open: bool = True
    """False once a call failed after publishing: the next call starts a new segment."""
    last_call: Call = field(default_factory=Call)
    """The last call recorded here (kept to say why a later call could not extend the segment)."""
    answers: list[Answer] = field(default_factory=list)
    """The answer of each completed call, in order (one per turn but the one in progress)."""

    @property
    def last_answer(self) -> Answer | None:
        """The last call's answer, once it completed: what the next call should send back."""
        return self.answers[-1] if self.answers and len(self.answers) == len(self.turns) else None


@dataclass(frozen=True)
class TurnPlan:
    """What one chat call will add: computed before generating, applied by the first chunk."""

    segment_index: int
    new_segment: bool
    context_ids: tuple[int, ...]
    """Tokens appended before the output (the template's delta for the new messages and the
    generation prompt; the full template for a new segment). The first chunk's ``context_ids``."""
    prompt_ids: tuple[int, ...]
    """The whole input of the first engine call: the segment so far plus ``context_ids``."""
    reason: NewSegmentReason | None = None
    """Why a new segment (None when the call extends the current one)."""
    call: Call = field(default_factory=Call)
    """The call itself: the segment keeps it once the call records a chunk."""
    forced: tuple[int, ...] = ()
    """Ids the proxy appended after the generation prompt that the engine did not sample (the opener of a
    call ``tool_choice`` asks for): the tail of ``context_ids``."""
    kept_rewrite: bool = False
    """The template rewrote the earlier turns and the segment was kept (``keep``): the engine sees its own ids."""


def new_segment_reason(seg: SegmentState | None, call: Call) -> NewSegmentReason:
    """Why ``call``, which the tokenizer could not continue from ``seg``, starts anew.

    Compared with the segment's last call: its tools, its messages (still the prefix?), then the
    message after them (the assistant's answer, sent back unchanged?). When all match, the chat
    template itself renders the same history differently (say, it drops earlier reasoning).
    """
    if seg is None or not seg.turns:
        return "first"
    if not seg.open:
        return "publish_failed"
    last = seg.last_call
    if call.tools != last.tools:
        return "tools_changed"
    n = len(last.messages)
    if call.messages[:n] != last.messages:
        return "history_diverged"
    if len(call.messages) == n or call.messages[n].get("role") != "assistant":
        return "assistant_dropped"
    answer = seg.last_answer
    if answer is None or not answer.echoed_by(call.messages[n]):
        return "assistant_edited"
    return "template_mismatch"


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

    def plan(
        self, messages: Messages, tokenizer: ChatTokenizer, tools: Tools = None, forced: Sequence[int] = (),
        rewritten: RewrittenHistory = "keep",
    ) -> TurnPlan:
        """How the call with ``messages`` extends the session (TITO) or starts a new segment; ``forced`` ids
        follow the generation prompt; ``rewritten`` says what a template that rewrote the history gets.

        Raises ValueError for messages the chat template cannot render.
        """
        seg, call, forced = self.current, Call.of(messages, tools), tuple(forced)
        if seg is not None and seg.open and seg.turns:
            sampled, kept = as_sampled(messages, seg.answers), False
            delta = tokenizer.continue_chat(seg.turns, sampled, tools=tools)
            if delta is None and rewritten == "keep" and new_segment_reason(seg, call) == "template_mismatch":
                delta = tokenizer.append_chat(seg.turns, sampled, len(seg.last_call.messages) + 1, tools=tools)
                kept = delta is not None
            if delta is not None:
                return TurnPlan(segment_index=seg.index, new_segment=False, context_ids=(*delta, *forced),
                                prompt_ids=(*seg.token_ids, *delta, *forced), call=call, forced=forced,
                                kept_rewrite=kept)
        template = (*tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools), *forced)
        index = 0 if seg is None else seg.index + 1
        return TurnPlan(segment_index=index, new_segment=True, context_ids=template, prompt_ids=template,
                        reason=new_segment_reason(seg, call), call=call, forced=forced)

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
        if context_ids or not seg.turns:  # a call's first chunk: its context is never empty (a template
            cut = len(context_ids) - len(plan.forced)  # or delta ends with the generation prompt)
            seg.turns.append((list(context_ids[:cut]), [*context_ids[cut:], *output_ids]))
            seg.last_call = plan.call
        else:  # a continuation chunk (after a preempt) samples on in the same turn
            seg.turns[-1][1].extend(output_ids)
        self.num_chunks += 1
        return self.num_chunks - 1

    def answered(self, plan: TurnPlan, answer: Answer) -> None:
        """The call of ``plan`` completed with ``answer``: what the next call should send back."""
        seg = self.current
        if seg is not None and seg.index == plan.segment_index and len(seg.answers) < len(seg.turns):
            seg.answers.append(answer)

    def close_segment(self, plan: TurnPlan) -> None:
        """A chunk publish of this segment failed or was lost: no later call may extend it."""
        seg = self.current
        if seg is not None and seg.index == plan.segment_index:
            seg.open = False

