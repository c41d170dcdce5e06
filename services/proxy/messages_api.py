"""Anthropic's Messages API (``POST /v1/messages``) as a thin adapter onto the chat-completions call.

Pure functions, no I/O, like :mod:`services.proxy.responses_api`: a request becomes the chat-completions
request the session machine serves (:func:`to_chat`), the finished ``chat.completion`` body becomes a
``message`` (:func:`answer`) or its streamed events (:func:`events`), so Claude-Code-style agents share
the one session machine and transcript. The mapping:

- ``system`` (a string or text blocks) is a leading system message; a message's content is a string or
  blocks: ``text``; an assistant's ``tool_use`` blocks are its ``tool_calls`` (``input`` as the JSON
  arguments: an echoed answer continues token-exact); a user's ``tool_result`` blocks are ``tool``
  messages, before the user's own text.
- ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``none``, ``any`` and
  ``tool``: the chat route's ``required`` and named function, served by forcing the call's opener;
  ``disable_parallel_tool_use``), ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``,
  ``top_k`` and ``stream`` map one to one.
- A reasoning model's thinking is a ``thinking`` block before the answer's text (``thinking`` enabled is
  accepted: whether the model thinks is its template's); sent back in an assistant message, it is the
  message's ``reasoning_content``, so the turn continues token-exact.
- Refused with 400, never ignored: Anthropic's server tools (a ``type`` other than ``custom``), image,
  document and ``redacted_thinking`` blocks.
- ``stop_reason``: ``tool_use`` for calls, ``max_tokens`` when cut, ``stop_sequence`` (with the matched
  ``stop_sequence``) when the reply ended at one of ``stop_sequences``, else ``end_turn``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.proxy.fields import ANTHROPIC_HARMLESS, refused_fields
from services.proxy.openai_api import ChatRequest
from services.proxy.wire import Call, Wire, parse, validate
from shared.errors import UnsupportedContent, UnsupportedParameter

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
"""A chat completion's finish reason -> Anthropic's ``stop_reason`` (anything else: ``end_turn``)."""


REFUSED = {
    "container": "no code-execution container is served",
    "mcp_servers": "no MCP servers are served: offer their tools as tools",
    "context_management": "the proxy does not edit a context",
    "output_config": "structured output and effort are not served",
    "speed": "not served",
    "diagnostics": "not served",
}
"""Messages fields the proxy knows and cannot honour, refused whenever they are set."""


class MessagesRequest(BaseModel):
    """The fields the adapter reads; every other one is harmless
    (:data:`~services.proxy.fields.ANTHROPIC_HARMLESS`) or refused by name."""

    model_config = ConfigDict(extra="allow")
    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None


def to_chat(body: MessagesRequest) -> dict[str, Any]:
    """The chat-completions request (as JSON data) that asks for the same turn."""
    refused: dict[str, str] = refused_fields(body.model_extra, ANTHROPIC_HARMLESS, REFUSED)
    if body.thinking and body.thinking.get("type") not in ("enabled", "adaptive", "disabled"):
        refused["thinking"] = f"unknown thinking type {body.thinking.get('type')!r}"
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type", "custom") != "custom":
            refused[f"tools.{i}"] = f"only custom tools are served, not the server tool {tool.get('type')!r}"
            continue
        spec = {"name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool.get("input_schema")}
        tools.append({"type": "function", "function": {k: v for k, v in spec.items() if v is not None}})
    if refused:
        fields = [{"field": name, "message": message} for name, message in refused.items()]
        names = ", ".join(f["field"] for f in fields)
        raise UnsupportedParameter(f"unsupported parameter(s): {names} ({fields[0]['message']})", fields=fields)
    system = _text(body.system, "system") if body.system else None
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(body.messages):
        messages += _message(message, i)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    if tools:
        chat["tools"] = tools
    choice = body.tool_choice or {}
    kind = choice.get("type")
    if kind is not None:
        chat["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}.get(
            kind, {"type": "function", "function": {"name": choice.get("name")}})
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    values = {"max_tokens": body.max_tokens, "stop": body.stop_sequences or None, "temperature": body.temperature,
              "top_p": body.top_p, "top_k": body.top_k}
    chat.update({k: v for k, v in values.items() if v is not None})
    return chat


def _message(message: dict[str, Any], index: int) -> list[dict[str, Any]]:
    role, content, where = message.get("role"), message.get("content"), f"messages.{index}.content"
    if isinstance(content, str) or content is None:
        return [{"role": role, "content": content or ""}]
    blocks = content if isinstance(content, list) else [content]
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id", ""), "type": "function", "function": {
                "name": block.get("name", ""), "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                            "content": _text(block.get("content"), f"{where}.{j}.content") or ""})
        else:
            raise UnsupportedContent(f"{where}.{j}: a {kind!r} block is not supported in a {role} message; this "
                                     "proxy serves text, tool_use and tool_result blocks of a text model",
                                     field=f"{where}.{j}", part_type=kind)
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
        if thinking:
            out["reasoning_content"] = "\n".join(thinking)
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": role, "content": "\n".join(texts)}] if texts or not results else [])


def _text(content: Any, field: str) -> str | None:
    """A string, or text blocks joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content if isinstance(content, list) else [content]):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise UnsupportedContent(f"{field}.{j}: a {kind!r} block is not supported; this proxy serves a text "
                                     "model (send text blocks or a string)", field=f"{field}.{j}", part_type=kind)
        texts.append(block["text"])
    return "\n".join(texts)


def answer(chat: dict[str, Any]) -> dict[str, Any]:
    """The ``message`` for a finished ``chat.completion`` body (its ``rein`` field carried over)."""
    choice = chat["choices"][0]
    content: list[dict[str, Any]] = []
    if choice["message"].get("reasoning_content") is not None:  # no signature: nothing to verify it by
        content.append({"type": "thinking", "thinking": choice["message"]["reasoning_content"], "signature": ""})
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    for call in choice["message"].get("tool_calls", ()):
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop_sequence = choice.get("stop_reason") if choice["finish_reason"] == "stop" else None
    stop_reason = "stop_sequence" if isinstance(stop_sequence, str) else STOP_REASONS.get(choice["finish_reason"],
                                                                                          "end_turn")
    body: dict[str, Any] = {
        "id": chat["id"].replace("chatcmpl", "msg", 1), "type": "message", "role": "assistant",
        "model": chat["model"], "content": content, "stop_reason": stop_reason,
        "stop_sequence": stop_sequence if isinstance(stop_sequence, str) else None,
        "usage": {"input_tokens": chat["usage"]["prompt_tokens"], "output_tokens": chat["usage"]["completion_tokens"]},
    }
    if "rein" in chat:
        body["rein"] = chat["rein"]
    return body


def events(chat: dict[str, Any]) -> Iterator[str]:
    """The answer as the Messages API streams it: ``message_start``, each content block started, its text or
    input JSON as one delta, stopped, then ``message_delta`` (the stop reason) and ``message_stop``."""

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"

    final = answer(chat)
    usage = final["usage"]
    start = {**final, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    yield event("message_start", message=start)
    for index, block in enumerate(final["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
        elif block["type"] == "thinking":
            yield event("content_block_start", index=index,
                        content_block={"type": "thinking", "thinking": "", "signature": ""})
            yield event("content_block_delta", index=index,
                        delta={"type": "thinking_delta", "thinking": block["thinking"]})
        else:
            yield event("content_block_start", index=index, content_block={**block, "input": {}})
            yield event("content_block_delta", index=index,
                        delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield event("content_block_stop", index=index)
    yield event("message_delta", delta={"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
                usage={"output_tokens": usage["output_tokens"]})
    yield event("message_stop")


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status (its error codes page); a prompt too long is a 400."""
    if status == 503:
        return "overloaded_error"
    if status >= 500:
        return "api_error"
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error"}.get(status, "invalid_request_error")


def error_body(detail: dict[str, Any], status: int) -> dict[str, Any]:
    """An error in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with rein's own body
    under ``detail`` beside ``error`` and inside it (the anthropic client keeps only ``error`` as the body)."""
    return {"type": "error", "error": {"type": error_type(status), "message": str(detail.get("message", "")),
                                       "detail": detail}, "detail": detail}


def error_event(detail: dict[str, Any], status: int) -> str:
    """A failure after the stream began, as the Messages API streams one (rein's detail under ``detail``)."""
    return f"event: error\ndata: {json.dumps(error_body(detail, status), separators=(',', ':'))}\n\n"


def _call(raw: bytes) -> Call:
    return Call(validate(ChatRequest, to_chat(parse(MessagesRequest, raw))), answer, events, error_event)


WIRE = Wire("/v1/messages", _call, error_body)
"""Anthropic's Messages API."""
