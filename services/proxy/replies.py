"""A call's answer: the sampled text read into content, tool calls and reasoning, and what the response reports.

Pure, and apart from the session machine because reading a reply is its own rule set (the request's
``stop`` strings, a reasoning model's thinking, the family's call markup and the request's
``tool_choice``); :meth:`~services.proxy.session_machine.Session.complete` reads each finished
generation with :func:`read_reply`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shared.model.reasoning import Reasoning
from shared.model.tool_calls import ParsedReply, ToolCallFormat, new_call_id, parse_reply

CallMarkup = Literal["calls", "malformed", "empty"]

ToolCalls = Literal["all", "none", "first"]
"""Which tool calls of a reply an answer carries (the request's ``tool_choice`` and ``parallel_tool_calls``)."""


@dataclass(frozen=True)
class ForceCall:
    """``tool_choice`` ``required`` (``name`` None) or a named function: the reply opens with a call.

    Served without constrained decoding: the family's call opener (and the function's name) follows the
    generation prompt as context the engine did not sample, never trained; everything after it is sampled
    from the policy's own distribution, and the chunk's ``forced_ids`` say what was forced."""

    name: str | None = None


def until_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` before the earliest of ``stops`` in it (all of it when none occurs), and that stop string."""
    found = [(at, -len(s), s) for s in stops if s and (at := text.find(s)) != -1]
    if not found:
        return text, None
    at, _, stop = min(found)  # the earliest; at one position, the longest
    return text[:at], stop


@dataclass(frozen=True)
class ChatOutcome:
    """A finished chat call: the text and what the response's ``rein`` field reports."""

    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    rein: dict[str, Any]
    soft_rejected: bool = False
    tool_calls: tuple[dict[str, Any], ...] = ()
    """OpenAI ``tool_calls`` parsed from the reply (then ``finish_reason`` is ``tool_calls``)."""
    stop_sequence: str | None = None
    """The request's ``stop`` string the reply ended at (left out of the content), if one."""
    reasoning: str | None = None
    """A reasoning model's thinking (``<think>…</think>``), answered apart from the content; None without."""
    call_markup: CallMarkup | None = None
    """What the reply's call markup was, if it had any: parsed ``calls``, ``malformed`` (answered whole as
    content), or ``empty`` (an empty list of calls, the model's own "no call": answered as the text around it)."""


@dataclass(frozen=True)
class Reply:
    """A generation's text as the agent is answered."""

    message: dict[str, Any]
    """The assistant message as the response carries it (what the agent's echo of it stands for)."""
    content: str
    tool_calls: tuple[dict[str, Any], ...]
    stop_sequence: str | None
    reasoning: str | None
    call_markup: CallMarkup | None


def read_reply(text: str, finish_reason: str, reasoning: Reasoning | None, fmt: ToolCallFormat,
               stop: Sequence[str] = (), calls: ToolCalls = "all") -> Reply:
    """``text`` up to the first of the request's ``stop`` strings (OpenAI leaves it out; the ids keep it), a
    reasoning model's thinking split off, and the rest split into content and tool calls when the model ended
    its turn (``finish_reason`` ``stop``: a reply cut by its budget is content, its calls may be cut too).
    ``calls``: ``none`` answers the text as content, ``first`` only the first call."""
    shown, matched = until_stop(text, stop) if finish_reason == "stop" else (text, None)
    thinking, shown = (None, shown) if reasoning is None else reasoning.split(shown)
    if thinking is not None:
        thinking, shown = thinking.strip(), shown.lstrip()
    parse = finish_reason == "stop" and calls != "none"
    reply = parse_reply(shown, fmt) if parse else None
    found = reply.calls[:1] if reply is not None and calls == "first" else reply.calls if reply else ()
    calls_out = tuple(c.openai(new_call_id(fmt)) for c in found)
    content = reply.content if reply is not None and (calls_out or reply.empty) else shown
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking is not None:
        message["reasoning_content"] = thinking
    if calls_out:
        message["tool_calls"] = list(calls_out)
    return Reply(message, content, calls_out, matched, thinking, _markup(reply))


def _markup(reply: ParsedReply | None) -> CallMarkup | None:
    if reply is None:
        return None
    return "calls" if reply.calls else "malformed" if reply.malformed else "empty" if reply.empty else None
