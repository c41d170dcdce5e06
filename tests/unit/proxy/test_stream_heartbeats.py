"""A streamed call that outlasts a heartbeat: SSE comments, then its frames or the wire's error frame."""

from __future__ import annotations

import asyncio
import json

from services.proxy import messages_api, openai_api, responses_api
from services.proxy.chat_route import _heartbeats
from services.proxy.replies import ChatOutcome
from services.proxy.wire import Call
from shared.errors import ContextOverflow, EngineUnavailable

CHAT = openai_api.WIRE.call(b'{"messages": [{"role": "user", "content": "x"}]}')


async def _collect(result: ChatOutcome | Exception, heartbeats: int = 2, wire: Call = CHAT) -> list[str]:
    """Frames of a call that ends only after ``heartbeats`` comments were sent (no timing involved)."""
    release = asyncio.Event()

    async def call() -> ChatOutcome:
        await release.wait()
        if isinstance(result, Exception):
            raise result
        return result

    frames: list[str] = []
    async for frame in _heartbeats(asyncio.ensure_future(call()), "m", 0.01, wire):
        frames.append(frame)
        if len(frames) == heartbeats:
            release.set()
    return frames


def test_comments_until_the_answer_then_its_frames() -> None:
    outcome = ChatOutcome(content="hi", finish_reason="stop", prompt_tokens=1, completion_tokens=1, rein={})
    frames = asyncio.run(_collect(outcome))
    first_data = next(i for i, f in enumerate(frames) if f.startswith("data:"))
    assert first_data >= 2 and all(f == ": keep-alive\n\n" for f in frames[:first_data])
    data = [json.loads(f.removeprefix("data: ")) for f in frames if f.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in data) == "hi"
    assert frames[-1] == "data: [DONE]\n\n"


def test_an_error_after_the_200_is_openais_streamed_error_frame() -> None:
    frames = asyncio.run(_collect(EngineUnavailable("no engine answered", engines=["http://e"])))
    error_frame, done = frames[-1].removesuffix("\n\n").split("\n\n")
    error = json.loads(error_frame.removeprefix("data: "))["error"]
    assert error["code"] == "engine_unavailable" and error["message"] == "no engine answered"
    assert error["detail"]["engines"] == ["http://e"] and done == "data: [DONE]"


def test_an_error_after_the_200_on_the_messages_wire_is_anthropics_error_event() -> None:
    wire = messages_api.WIRE.call(b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}')
    frames = asyncio.run(_collect(EngineUnavailable("no engine answered"), wire=wire))
    assert all(f == ": keep-alive\n\n" for f in frames[:-1])
    event, data = frames[-1].removesuffix("\n\n").split("\n")
    assert event == "event: error"
    body = json.loads(data.removeprefix("data: "))
    assert body["error"] | {"detail": None} == {"type": "overloaded_error", "message": "no engine answered",
                                                "detail": None}
    assert body["detail"]["error"] == "engine_unavailable", "rein's own name beside Anthropic's type"


def test_an_error_after_the_200_on_the_responses_wire_ends_with_response_failed() -> None:
    """A stream that ended with only an ``error`` event left the openai client raising "Didn't receive a
    `response.completed` event"; ``response.failed`` carries the error where a client reads OpenAI's."""
    wire = responses_api.WIRE.call(b'{"model": "m", "input": "x"}')
    frames = asyncio.run(_collect(ContextOverflow("no room", context_window=8), wire=wire))
    events = [frame.removesuffix("\n\n").split("\n") for frame in frames[-1].split("\n\n") if frame]
    assert [event for event, _ in events] == ["event: response.created", "event: response.failed"]
    failed = json.loads(events[-1][1].removeprefix("data: "))
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "context_length_exceeded"
    assert failed["detail"] == {"error": "context_overflow", "message": "no room", "context_window": 8}
