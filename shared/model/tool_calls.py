"""Tool calls in a model's generated text, per its family's convention, pure.

An engine returns text; an OpenAI client expects ``tool_calls``. :func:`parse_reply` splits a
finished reply into the content an agent reads and the calls it runs, for the conventions the
small open models are trained on:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5/3),
  and SmolLM2's trained form, a JSON array of such objects inside one ``<tool_call>`` tag; text
  around the tags is the content.
- ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (Llama 3.1/3.2),
  optionally after ``<|python_tag|>``, several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of calls; text before it is the content.
- ``pythonic``: the whole reply is a Python list of keyword calls, ``[f(a=1), g(b="x")]``
  (Llama 3.2/4's pythonic form), arguments Python literals.

A call is ``{"name": str, "arguments" | "parameters": object}`` (a JSON string of an object is
taken too). A reply whose call markup does not parse, or holds anything but such calls, is
returned whole as content with no calls: the model's mistake is training data, never an error.
An empty list of calls (``<tool_call>[]</tool_call>``, what SmolLM2's tools prompt asks for when no
call is needed; ``[TOOL_CALLS][]``) is the model's own "no call": an answer without calls, its text
around the markup the content.

Why not a library: ``transformers``' ``parse_response`` (5.x) parses these forms from a declarative
response template, but rein would write one per family anyway (a tokenizer converted from GGUF
ships none), and it joins the text around the calls without a separator ("Sure. <call> ok" gives
"Sure.ok"); ``renderers`` (PyPI, 0.1.x) covers the large recent families but neither SmolLM2 nor
a generic Hermes form, and pulls ``openai-harmony``, ``tiktoken`` and a pre-release config package.
"""

from __future__ import annotations

import ast
import enum
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any


class ToolCallFormat(enum.StrEnum):
    """How a model writes tool calls (SGLang's and vLLM's ``--tool-call-parser`` names where they exist)."""

    NONE = "none"
    """Never parse: every reply is content."""
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    PYTHONIC = "pythonic"


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI's ``tool_calls`` carry it: a function name and its arguments as JSON text."""

    name: str
    arguments: str
    """A JSON object, as text (OpenAI's ``function.arguments``)."""

    def openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into what the agent reads and the calls it should run."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    malformed: bool = False
    """The reply has the convention's call markup, but it does not parse into calls (then it is all content)."""
    empty: bool = False
    """The markup held only empty lists of calls: the model said it calls nothing (not malformed)."""


class _NotCalls(ValueError):
    """The markup is there but what it holds is not a list of calls."""


def detect_format(chat_template: str) -> ToolCallFormat:
    """The convention a chat template's source shows. A template that shows none (SmolLM2's ChatML,
    which ignores tools) gets ``hermes``, the form rein renders tools and calls in for such models."""
    if "[TOOL_CALLS]" in chat_template:
        return ToolCallFormat.MISTRAL
    if "<tool_call>" in chat_template:
        return ToolCallFormat.HERMES
    if "[func_name1(" in chat_template:  # the pythonic templates' instruction to the model
        return ToolCallFormat.PYTHONIC
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.HERMES


_ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id(fmt: ToolCallFormat) -> str:
    """A fresh id for a parsed call, in the form the family's template takes back: Mistral's templates raise
    unless an id is 9 alphanumerics (as vLLM's and SGLang's Mistral parsers make them); others take
    OpenAI's ``call_`` and 24 alphanumerics."""
    if fmt is ToolCallFormat.MISTRAL:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def call_opener(fmt: ToolCallFormat, name: str | None = None, *, array: bool = False) -> str | None:
    """The text that opens a call in ``fmt`` (the function's name and the start of its arguments too when
    ``name`` is given): what the proxy appends after the generation prompt to serve ``tool_choice``
    ``required`` or a named function without constrained decoding. ``array``: the hermes form as a JSON
    array inside one tag (SmolLM2's tools prompt). None where ``fmt`` writes no calls."""
    quoted = json.dumps(name, ensure_ascii=False) if name is not None else ""
    if fmt is ToolCallFormat.HERMES:
        if name is None:
            return "<tool_call>"
        return f'<tool_call>[\n{{"name": {quoted}, "arguments": ' if array else \
            f'<tool_call>\n{{"name": {quoted}, "arguments": '
    if fmt is ToolCallFormat.MISTRAL:
        return "[TOOL_CALLS]" if name is None else f'[TOOL_CALLS][{{"name": {quoted}, "arguments": '
    if fmt is ToolCallFormat.LLAMA3_JSON:
        return '{"name": "' if name is None else f'{{"name": {quoted}, "parameters": '
    if fmt is ToolCallFormat.PYTHONIC:
        return "[" if name is None else f"[{name}("
    return None


def parse_reply(text: str, fmt: ToolCallFormat) -> ParsedReply:
    """``text`` (a finished reply, special tokens already dropped) as content and tool calls."""
    try:
        if fmt is ToolCallFormat.HERMES:
            return _hermes(text)
        if fmt is ToolCallFormat.LLAMA3_JSON:
            return _llama3_json(text)
        if fmt is ToolCallFormat.MISTRAL:
            return _mistral(text)
        if fmt is ToolCallFormat.PYTHONIC:
            return _pythonic(text)
    except (_NotCalls, ValueError, SyntaxError, RecursionError):
        return ParsedReply(text, malformed=True)
    return ParsedReply(text)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes(text: str) -> ParsedReply:
    if "<tool_call>" not in text and "</tool_call>" not in text:
        return ParsedReply(text)
    calls: list[ToolCall] = []
    rest: list[str] = []
    pos = 0
    for match in _HERMES.finditer(text):
        rest.append(text[pos : match.start()])
        body = json.loads(match.group(1))
        if body != []:  # SmolLM2's "no call"
            calls.extend(_calls(body if isinstance(body, list) else [body]))
        pos = match.end()
    rest.append(text[pos:])
    content = "".join(rest)
    if "<tool_call>" in content or "</tool_call>" in content:
        raise _NotCalls("an unclosed or stray <tool_call> tag")
    return ParsedReply(_joined(rest), tuple(calls), empty=not calls)


def _llama3_json(text: str) -> ParsedReply:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedReply(text)
    decoder = json.JSONDecoder()
    calls: list[Any] = []
    pos = 0
    while pos < len(body):
        obj, pos = decoder.raw_decode(body, pos)
        calls.append(obj)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
    return ParsedReply("", tuple(_calls(calls)))


def _mistral(text: str) -> ParsedReply:
    head, marker, tail = text.partition("[TOOL_CALLS]")
    if not marker:
        return ParsedReply(text)
    body = json.loads(tail)
    if body == []:
        return ParsedReply(head.strip(), empty=True)
    return ParsedReply(head.strip(), tuple(_calls(body if isinstance(body, list) else [body])))


def _pythonic(text: str) -> ParsedReply:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not body.startswith("[") or "(" not in body:  # a list of calls has both; plain text rarely does
        return ParsedReply(text)
    if not body.endswith("]"):
        raise _NotCalls("a list of calls that does not end")
    tree = ast.parse(body, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        raise _NotCalls("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise _NotCalls("not a keyword call of a plain name")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(arguments) != len(node.keywords):
            raise _NotCalls("**kwargs in a call")
        calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return ParsedReply("", tuple(calls))


def _calls(objects: list[Any]) -> list[ToolCall]:
    """Each object as a call; :class:`_NotCalls` when one is not ``{"name", "arguments"|"parameters"}``."""
    if not objects:
        raise _NotCalls("no call in the markup")
    out = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise _NotCalls(f"not a call: {obj!r:.80}")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise _NotCalls(f"arguments of {obj['name']} are not an object")
        out.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
    return out


def _joined(pieces: list[str]) -> str:
    """The text around the calls: each piece trimmed, the non-empty ones joined by a newline."""
    return "\n".join(p.strip() for p in pieces if p.strip())
