"""The OpenAI chat-completions subset the proxy speaks: request model, response bodies, SSE frames, its wire.

Pure functions of their inputs. Messages reach the model's chat template as plain
dicts in OpenAI's shape (roles system, user, assistant, tool; an assistant's
``tool_calls``; a tool message's ``tool_call_id``), and ``tools`` go to the template
too; what the template does with them is the model family's business. A ``developer`` message
(OpenAI's name for the system message of its newer models) is a system message. Content is text:
a string or a list of text parts (joined by newlines); any other part (images, audio)
is a 400 ``unsupported_content``, as the proxy serves text models. Every request field is honoured,
accepted as harmless or refused by name (:mod:`services.proxy.fields`); fields the proxy does use
are validated and a bad one is a 422 naming it. ``n`` must be 1 (one session is one trajectory).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.proxy.fields import OPENAI_HARMLESS, refused_fields
from services.proxy.replies import ForceCall, ToolCalls
from services.proxy.wire import Call, Wire, parse
from shared.errors import InvalidRequest, UnsupportedContent, UnsupportedParameter
from shared.schemas import new_id


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts can be served (see :meth:`ChatMessage.template`)."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = ""
    """OpenAI sends a JSON string; a dict is taken as well (what chat templates expect)."""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant messages only."""
    tool_call_id: str | None = None
    """Tool messages: the call this is the result of."""
    reasoning_content: str | None = None
    """Assistant messages: a reasoning model's thinking as the proxy answered it (optional when sent back)."""

    def template(self, index: int) -> dict[str, Any]:
        """This message as the chat template takes it: content as one string (None is empty), the
        other fields as OpenAI spells them. 400 ``unsupported_content`` for a part that is not text."""
        role = "system" if self.role == "developer" else self.role  # templates know system, not developer
        out: dict[str, Any] = {"role": role, "content": self._text(index)}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out

    def _text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            field = f"messages.{index}.content.{j}"
            if part.type == "text" and part.text is None:
                fields = [{"field": field, "message": "a text part needs 'text'"}]
                raise InvalidRequest(f"{field}: a text part needs 'text'", fields=fields)
            if part.text is None or part.type != "text":
                raise UnsupportedContent(
                    f"{field}: content part of type {part.type!r} is not supported; this proxy serves a text model "
                    "(send text parts or a string)", field=field, part_type=part.type,
                )
            texts.append(part.text)
        return "\n".join(texts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    """A tool the agent offers (``{"type": "function", "function": {...}}``); rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionSpec


REFUSED = {
    "seed": "a per-request seed is not served: the engine samples with its own generator",
    "reasoning_effort": "the served model's reasoning is not steered by an effort",
    "verbosity": "the served model's length is not steered by a verbosity",
    "audio": "this proxy serves a text model",
    "web_search_options": "no hosted tools are served",
    "moderation": "no moderation is served",
}
"""Chat-completions fields the proxy knows and cannot honour, refused whenever they are set."""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    """Not OpenAI; accepted as in vLLM / SGLang."""
    ignore_eos: bool = False
    """Not OpenAI; as in vLLM / SGLang: keep generating past ``<|end|>`` until the budget."""
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    stop: str | list[str] | None = None
    """OpenAI's: up to 4 strings; the reply ends at the first one (which the content leaves out)."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > 4 or not all(strings):
            raise ValueError("stop takes up to 4 non-empty strings")
        return value

    tool_choice: str | dict[str, Any] | None = None
    """``auto`` (the default), ``none`` (the reply is content, never calls), ``required`` and a named function
    (``{"type": "function", "function": {"name": ...}}``: the reply opens with the family's call opener, see
    :class:`~services.proxy.replies.ForceCall`) are honoured."""
    parallel_tool_calls: bool | None = None
    """``false``: the answer carries the reply's first call only (the recorded ids keep every token)."""
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    top_logprobs: int | None = None
    modalities: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    """``include_usage``: a chunk with the usage and no choices before ``[DONE]`` (the others carry none)."""

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def force_call(self) -> ForceCall | None:
        """The call ``tool_choice`` forces, if any; 422 naming ``tool_choice`` when it names no offered tool."""
        if self.tool_choice in (None, "auto", "none"):
            return None
        names = [t.function.name for t in self.tools or ()]
        if not names:
            raise InvalidRequest("tool_choice: forcing a call needs tools",
                                 fields=[{"field": "tool_choice", "message": "forcing a call needs tools"}])
        if self.tool_choice == "required":
            return ForceCall()
        assert isinstance(self.tool_choice, dict)  # refuse_unsupported let only a named function through
        name = (self.tool_choice.get("function") or {}).get("name")
        if name not in names:
            message = f"names {name!r}, which is not among the tools offered ({', '.join(names)})"
            raise InvalidRequest(f"tool_choice {message}", fields=[{"field": "tool_choice", "message": message}])
        return ForceCall(str(name))

    def tool_calls(self) -> ToolCalls:
        """Which calls of the reply the answer carries."""
        if self.tool_choice == "none":
            return "none"
        return "first" if self.parallel_tool_calls is False else "all"

    def refuse_unsupported(self) -> None:
        """400 ``unsupported_parameter`` naming each parameter that would change what is sampled or answered
        in a way this proxy does not do (constrained decoding, penalties, biases): refused, never ignored."""
        why = {
            "tool_choice": "only 'auto', 'none', 'required' and a named function"
            if not _known_tool_choice(self.tool_choice) else None,
            "response_format": "structured output needs constrained decoding"
            if self.response_format and self.response_format.get("type") != "text" else None,
            "logit_bias": "would sample from another distribution than the one trained" if self.logit_bias else None,
            "presence_penalty": "would sample from another distribution than the one trained"
            if self.presence_penalty else None,
            "frequency_penalty": "would sample from another distribution than the one trained"
            if self.frequency_penalty else None,
            "logprobs": "not answered; the response's rein field carries the sampled ids" if self.logprobs else None,
            "functions": "the legacy functions API: send tools" if self.functions else None,
            "function_call": "the legacy functions API: send tool_choice" if self.function_call is not None else None,
            "top_logprobs": "not answered; the response's rein field carries the sampled ids"
            if self.top_logprobs else None,
            "modalities": "this proxy serves a text model" if set(self.modalities or ()) - {"text"} else None,
            **refused_fields(self.model_extra, OPENAI_HARMLESS, REFUSED),
        }
        fields = [{"field": name, "message": message} for name, message in why.items() if message]
        if fields:
            names = ", ".join(f["field"] for f in fields)
            raise UnsupportedParameter(f"unsupported parameter(s): {names} ({fields[0]['message']})", fields=fields)

    def budget(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else default

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (400 ``unsupported_content`` for non-text parts)."""
        return [m.template(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them; None when the request offers none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def _known_tool_choice(choice: str | dict[str, Any] | None) -> bool:
    if isinstance(choice, dict):
        function = choice.get("function")
        return choice.get("type") == "function" and isinstance(function, dict) and isinstance(function.get("name"), str)
    return choice in (None, "auto", "none", "required")


def completion(
    *,
    model: str,
    content: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    rein: dict[str, Any] | None = None,
    tool_calls: Sequence[dict[str, Any]] = (),
    stop_sequence: str | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` body; ``rein`` carries token ids and versions for tools that want them.
    With ``tool_calls`` the message carries them and an empty content is null, as OpenAI's. The ``stop``
    string the reply ended at is the choice's ``stop_reason``, as vLLM's (Messages answers it). A reasoning
    model's thinking is the message's ``reasoning_content``, as SGLang's and vLLM's reasoning parsers answer it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message = {"role": "assistant", "content": content or None, "tool_calls": list(tool_calls)}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    body: dict[str, Any] = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                     **({"stop_reason": stop_sequence} if stop_sequence is not None else {})}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if rein is not None:
        body["rein"] = rein
    return body


def empty_completion(model: str, rein: dict[str, Any]) -> dict[str, Any]:
    """The soft-reject answer: an empty assistant message, so a black-box agent carries on."""
    return completion(model=model, content="", finish_reason="stop", prompt_tokens=0, completion_tokens=0, rein=rein)


def sse_frames(body: dict[str, Any], include_usage: bool = False) -> Iterator[str]:
    """A finished ``chat.completion`` as ``chat.completion.chunk`` SSE frames, then ``[DONE]``.

    The proxy streams only after the generation is complete and published (a chunk
    must be on Kafka before the agent sees its tokens, and a rejection must be able
    to answer with a real status), so the frames carry role, content, each tool call whole
    (OpenAI's delta shape: ``index``, ``id``, ``type``, ``function`` name and arguments), finish, and with
    ``include_usage`` a usage chunk of its own (else the usage rides on the finish chunk).
    """
    choice = body["choices"][0]
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def frame(delta: dict[str, Any], finish: str | None, **extra: Any) -> str:
        payload = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    yield frame({"role": "assistant", "content": ""}, None)
    if choice["message"].get("reasoning_content"):
        yield frame({"reasoning_content": choice["message"]["reasoning_content"]}, None)
    content = choice["message"]["content"]
    if content:
        yield frame({"content": content}, None)
    for index, call in enumerate(choice["message"].get("tool_calls", ())):
        yield frame({"tool_calls": [{"index": index, **call}]}, None)
    extra: dict[str, Any] = {"usage": None if include_usage else body["usage"]}
    if "rein" in body:
        extra["rein"] = body["rein"]
    yield frame({}, choice["finish_reason"], **extra)
    if include_usage:  # OpenAI's stream_options.include_usage: the usage in a chunk of its own, no choices
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': body['usage']}, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


OPENAI_CODES = {"context_overflow": "context_length_exceeded"}
"""rein's error names that OpenAI's API spells otherwise (``error.code``); agents catch
``context_length_exceeded`` to compact their history. Every other name is its own code."""


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
        status, "invalid_request_error")


def param_of(detail: dict[str, Any]) -> str | None:
    """The request field an error is about, if it names one (the first of ``fields``, or ``field``)."""
    fields = detail.get("fields")
    if isinstance(fields, list) and fields and isinstance(fields[0], dict):
        return str(fields[0].get("field")) if fields[0].get("field") is not None else None
    field = detail.get("field")
    return field if isinstance(field, str) else None


def error_body(detail: dict[str, Any], status: int) -> dict[str, Any]:
    """An error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with rein's own body
    under ``detail`` twice: beside ``error`` (what rein's runner reads over plain HTTP: ``detail.error`` is
    rein's name) and inside it (the official clients keep only ``error`` as the exception's ``body``)."""
    name = str(detail.get("error", ""))
    error = {"message": str(detail.get("message", "")), "type": error_type(status), "param": param_of(detail),
             "code": OPENAI_CODES.get(name, name), "detail": detail}
    return {"error": error, "detail": detail}


def sse_error_frame(detail: dict[str, Any], status: int) -> str:
    """A failure after the stream began: OpenAI's streamed ``{"error": ...}`` frame (which the openai client
    raises), as :func:`error_body`, then ``[DONE]``."""
    body = error_body(detail, status)
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\ndata: [DONE]\n\n"


def _call(raw: bytes) -> Call:
    request = parse(ChatRequest, raw)
    usage = bool((request.stream_options or {}).get("include_usage"))
    return Call(request, lambda body: body, lambda body: sse_frames(body, usage), sse_error_frame)


WIRE = Wire("/v1/chat/completions", _call, error_body)
"""OpenAI's chat completions: the session machine's own request, its answer as it is."""
