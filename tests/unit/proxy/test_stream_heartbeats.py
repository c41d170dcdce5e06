"""A streamed call that outlasts a heartbeat: SSE comments, then its frames or OpenAI's error frame."""

from __future__ import annotations

import asyncio
import json

from services.proxy.app import _heartbeats
from services.proxy.session_machine import ChatOutcome
from shared.errors import EngineUnavailable


async def _collect(result: ChatOutcome | Exception) -> list[str]:
    async def call() -> ChatOutcome:
        await asyncio.sleep(0.05)
        if isinstance(result, Exception):
            raise result
        return result

    task = asyncio.ensure_future(call())
    return [frame async for frame in _heartbeats(task, "m", 0.01)]


def test_comments_until_the_answer_then_its_frames() -> None:
    outcome = ChatOutcome(content="hi", finish_reason="stop", prompt_tokens=1, completion_tokens=1, rein={})
    frames = asyncio.run(_collect(outcome))
    keep = [f for f in frames if f == ": keep-alive\n\n"]
    data = [json.loads(f.removeprefix("data: ")) for f in frames if f.startswith("data: {")]
    assert len(keep) >= 2 and frames.index(keep[-1]) < frames.index(next(f for f in frames if f.startswith("data:")))
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in data) == "hi"
    assert frames[-1] == "data: [DONE]\n\n"


def test_an_error_after_the_200_is_openais_streamed_error_frame() -> None:
    frames = asyncio.run(_collect(EngineUnavailable("no engine answered", engines=["http://e"])))
    error = json.loads(frames[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_unavailable" and error["message"] == "no engine answered"
    assert error["detail"]["engines"] == ["http://e"] and frames[-1] == "data: [DONE]\n\n"
