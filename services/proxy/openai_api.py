"""The OpenAI chat-completions subset the proxy speaks: request model, response bodies, SSE frames.

Pure functions of their inputs. Unknown request fields (``tools``, ``stop``, ...)
are accepted and ignored, as the tiny policy has no use for them; fields the proxy
does use are validated and a bad one is a 422 naming it. ``n`` must be 1 (one
session is one trajectory).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas import new_id


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return " ".join(part.text for part in self.content)


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
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

    def budget(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else default

    def pairs(self) -> list[tuple[str, str]]:
        return [(m.role, m.text()) for m in self.messages]


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float = Field(allow_inf_nan=False)
    """A NaN or infinite reward would poison every advantage of its group: refused with 422."""
    status: Literal["completed", "truncated", "failed"] = "completed"
    error: str = Field(default="", max_length=200)
    """Why a ``failed`` session failed (the agent's error name); recorded on ``SessionFinished``."""


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = "weight_update"
    timeout_s: float | None = Field(default=None, gt=0, le=3600)
    pause_id: str | None = Field(default=None, min_length=1, max_length=128)
    """The caller's id for this pause (renew and resume name it); the proxy makes one when absent."""
    lease_s: float | None = Field(default=None, gt=0, le=3600)


class RenewBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pause_id: str = Field(min_length=1, max_length=128)
    lease_s: float | None = Field(default=None, gt=0, le=3600)


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | None = None
    reason: str = "weight_update"
    pause_id: str | None = Field(default=None, min_length=1, max_length=128)
    """Resume only if this is the current pause (409 ``stale_pause`` otherwise); absent: resume whatever it is."""


def completion(
    *,
    model: str,
    content: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    rein: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` body; ``rein`` carries token ids and versions for tools that want them."""
    body: dict[str, Any] = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}
        ],
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


def sse_frames(body: dict[str, Any]) -> Iterator[str]:
    """A finished ``chat.completion`` as ``chat.completion.chunk`` SSE frames, then ``[DONE]``.

    The proxy streams only after the generation is complete and published (a chunk
    must be on Kafka before the agent sees its tokens, and a rejection must be able
    to answer with a real status), so the frames carry role, content, finish.
    """
    choice = body["choices"][0]
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def frame(delta: dict[str, Any], finish: str | None, **extra: Any) -> str:
        payload = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    yield frame({"role": "assistant", "content": ""}, None)
    content = choice["message"]["content"]
    if content:
        yield frame({"content": content}, None)
    extra: dict[str, Any] = {"usage": body["usage"]}
    if "rein" in body:
        extra["rein"] = body["rein"]
    yield frame({}, choice["finish_reason"], **extra)
    yield "data: [DONE]\n\n"
