"""OpenAI's Responses API (``POST /v1/responses``) as a thin adapter onto the chat-completions call.

Pure functions, no I/O. A request becomes the chat-completions request the session machine already
serves (:func:`to_chat`), and the finished ``chat.completion`` body becomes a ``response`` object
(:func:`answer`) or its streamed events (:func:`events`): one session, one transcript, the same
recorded ids whichever wire an agent speaks. The mapping:

- ``instructions`` is a leading system message; ``input`` is a user message (a string) or a list of
  items: messages (roles ``user``, ``system``, ``developer`` as system, ``assistant``; text parts
  ``input_text`` / ``output_text``), ``function_call`` items (folded into the assistant message before
  them, as its ``tool_calls``, so an echoed answer continues token-exact), ``function_call_output``
  items (``tool`` messages) and ``reasoning`` items (the thinking of the assistant message after them,
  its ``reasoning_content``; a reasoning model's answer carries one before its message).
- ``tools`` of type ``function`` (flat: ``name``, ``description``, ``parameters``), ``tool_choice``,
  ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p`` and ``stream`` map one to one.
- Refused with 400, never ignored: ``previous_response_id`` and ``conversation`` (the proxy keeps no
  responses: send the whole input, as ``store: false`` clients do), hosted tools (web search, file
  search, ...), non-text parts and item types a text model cannot take, and a ``text.format`` other
  than text (structured output needs constrained decoding).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.proxy.fields import OPENAI_HARMLESS, refused_fields
from services.proxy.openai_api import OPENAI_CODES, ChatRequest, error_body
from services.proxy.wire import Call, Wire, parse, validate
from shared.errors import UnsupportedContent, UnsupportedParameter
from shared.schemas import new_id

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


REFUSED = {
    "prompt": "no stored prompt templates are served: send instructions and input",
    "background": "no background responses are served",
    "background_options": "no background responses are served",
    "context_management": "the proxy does not compact a context",
    "max_tool_calls": "the proxy does not cap a response's tool calls",
    "moderation": "no moderation is served",
    "image": "this proxy serves a text model",
    "access_programs": "not served",
}
"""Responses fields the proxy knows and cannot honour, refused whenever they are set."""


class ResponsesRequest(BaseModel):
    """The fields the adapter reads; every other one is harmless (:data:`~services.proxy.fields.OPENAI_HARMLESS`)
    or refused by name."""

    model_config = ConfigDict(extra="allow")
    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    """``effort`` cannot be honoured (refused when set); ``summary`` is harmless."""
    truncation: str | None = None
    """``disabled`` (the default) is what the proxy does; ``auto`` (drop input to fit) is refused."""
    top_logprobs: int | None = None


def to_chat(body: ResponsesRequest) -> dict[str, Any]:
    """The chat-completions request (as JSON data) that asks for the same turn."""
    text_format = (body.text or {}).get("format")
    refused = {
        "previous_response_id": "the proxy keeps no responses: send the whole input" if body.previous_response_id
        else None,
        "conversation": "the proxy keeps no conversations: send the whole input" if body.conversation else None,
        "text.format": "structured output needs constrained decoding"
        if text_format is not None and not (isinstance(text_format, dict) and text_format.get("type", "text") == "text")
        else None,
        "text.verbosity": "the served model's length is not steered by a verbosity"
        if (body.text or {}).get("verbosity") is not None else None,
        "reasoning.effort": "the served model's reasoning is not steered by an effort"
        if (body.reasoning or {}).get("effort") is not None else None,
        "truncation": "the proxy never drops input to fit: a prompt too long is context_length_exceeded"
        if body.truncation not in (None, "disabled") else None,
        "top_logprobs": "not answered; the response's rein field carries the sampled ids" if body.top_logprobs
        else None,
        **refused_fields(body.model_extra, OPENAI_HARMLESS, REFUSED),
    }
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            refused[f"tools.{i}"] = f"only function tools are served, not {tool.get('type')!r}"
            continue
        spec = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        tools.append({"type": "function", "function": spec})
    fields = [{"field": name, "message": message} for name, message in refused.items() if message]
    if fields:
        names = ", ".join(f["field"] for f in fields)
        raise UnsupportedParameter(f"unsupported parameter(s): {names} ({fields[0]['message']})", fields=fields)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += [{"role": "user", "content": body.input}] if isinstance(body.input, str) else _messages(body.input)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    if tools:
        chat["tools"] = tools
    tool_choice: Any = body.tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    values = {"tool_choice": tool_choice, "parallel_tool_calls": body.parallel_tool_calls,
              "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p}
    chat.update({k: v for k, v in values.items() if v is not None})
    return chat


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    thinking: str | None = None
    """A reasoning item's text, for the assistant message it comes before."""
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role", ""), item.get("role", ""))
            out.append({"role": role, "content": _text(item.get("content"), f"input.{i}.content")})
            if role == "assistant" and thinking is not None:
                out[-1]["reasoning_content"], thinking = thinking, None
        elif kind == "reasoning":
            thinking = _reasoning_text(item, f"input.{i}")
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)  # the answer's calls follow its message item
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thinking is not None:
                    out[-1]["reasoning_content"], thinking = thinking, None
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                        "content": _text(item.get("output"), f"input.{i}.output")})
        else:
            raise UnsupportedContent(f"input.{i}: an item of type {kind!r} is not supported; this proxy serves "
                                     "messages and function calls of a text model", field=f"input.{i}", part_type=kind)
    return out


def _reasoning_text(item: dict[str, Any], field: str) -> str:
    """A reasoning item's thinking: its ``reasoning_text`` parts (what the proxy answers), else its summary."""
    if item.get("encrypted_content") and not item.get("content"):
        raise UnsupportedContent(f"{field}: an encrypted reasoning item is not this proxy's: send back the "
                                 "reasoning item it answered", field=field, part_type="reasoning")
    parts = item.get("content") or item.get("summary") or []
    return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


def _text(content: Any, field: str) -> str | None:
    """A message's content as text: a string, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content if isinstance(content, list) else [content]):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedContent(f"{field}.{j}: content part of type {kind!r} is not supported; this proxy serves "
                                     "a text model (send text parts or a string)", field=f"{field}.{j}", part_type=kind)
        texts.append(part["text"])
    return "\n".join(texts)


def answer(chat: dict[str, Any], request: ResponsesRequest) -> dict[str, Any]:
    """The ``response`` object for a finished ``chat.completion`` body (its ``rein`` field carried over)."""
    return _response(chat, request, "incomplete" if _cut(chat) else "completed")


def _cut(chat: dict[str, Any]) -> bool:
    return bool(chat["choices"][0]["finish_reason"] == "length")


def _output(chat: dict[str, Any]) -> list[dict[str, Any]]:
    message = chat["choices"][0]["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content") is not None:
        output.append({"type": "reasoning", "id": new_id("rs"), "status": "completed", "summary": [],
                       "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content") or not message.get("tool_calls"):  # an empty reply is an empty message, echoed back
        output.append({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"] or "", "annotations": []}]})
    for call in message.get("tool_calls", ()):
        output.append({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    return output


def _response(chat: dict[str, Any], request: ResponsesRequest, status: str) -> dict[str, Any]:
    usage = chat["usage"]
    body: dict[str, Any] = {
        "id": chat["id"].replace("chatcmpl", "resp", 1), "object": "response", "created_at": chat["created"],
        "status": status, "model": chat["model"], "output": _output(chat), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
        "temperature": request.temperature, "top_p": request.top_p, "max_output_tokens": request.max_output_tokens,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }
    if "rein" in chat:
        body["rein"] = chat["rein"]
    return body


def events(chat: dict[str, Any], request: ResponsesRequest) -> Iterator[str]:
    """The answer as the Responses API streams it: ``response.created``, each output item added, its text or
    arguments as one delta, done, then ``response.completed`` (``response.incomplete`` when cut)."""
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    final = answer(chat, request)
    yield event("response.created", response={**final, "status": "in_progress", "output": [], "usage": None})
    yield event("response.in_progress", response={**final, "status": "in_progress", "output": [], "usage": None})
    for index, item in enumerate(final["output"]):
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            yield event("response.reasoning_text.delta", **ids, content_index=0, delta=text)
            yield event("response.reasoning_text.done", **ids, content_index=0, text=text)
        elif item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            yield event("response.content_part.added", **ids, content_index=0, part={**part, "text": ""})
            yield event("response.output_text.delta", **ids, content_index=0, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ids, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event(f"response.{final['status']}", response=final)


def failed_events(detail: dict[str, Any], request: ResponsesRequest) -> str:
    """A failure after the stream began (only keep-alive comments were sent), as the Responses API ends a
    failed response: ``response.created``, then ``response.failed`` whose ``response.error`` holds the code
    and message (rein's detail beside them, and under the event's ``detail``), so a client reads rein's error
    where it reads OpenAI's, not a stream that ended without ``response.completed``."""
    name = str(detail.get("error", ""))
    response: dict[str, Any] = {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": request.model, "output": [], "error": None, "incomplete_details": None,
        "instructions": request.instructions, "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [], "temperature": request.temperature,
        "top_p": request.top_p, "max_output_tokens": request.max_output_tokens, "usage": None,
    }
    failed = {**response, "status": "failed",
              "error": {"code": OPENAI_CODES.get(name, name), "message": str(detail.get("message", "")),
                        "detail": detail}}
    events = [("response.created", {"response": response}), ("response.failed", {"response": failed, "detail": detail})]
    return "".join(
        f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n, **data}, separators=(',', ':'))}\n\n"
        for n, (kind, data) in enumerate(events))


def _call(raw: bytes) -> Call:
    request = parse(ResponsesRequest, raw)
    return Call(validate(ChatRequest, to_chat(request)), lambda body: answer(body, request),
                lambda body: events(body, request), lambda detail, _status: failed_events(detail, request))


WIRE = Wire("/v1/responses", _call, error_body)
"""OpenAI's Responses API; its errors in OpenAI's shape."""
