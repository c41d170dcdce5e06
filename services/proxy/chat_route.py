"""The one chat endpoint behind every wire's routes: a call in the wire's shape becomes the session's chat call.

The session is named by headers or an API key, or by a session key in the path (:mod:`services.proxy.auth`);
the wire parses the body into the chat-completions request and writes the finished ``chat.completion``
back, whole or streamed. A streamed call answered within one heartbeat gets its real status, errors
included; a longer one commits to 200 and is kept alive by SSE comments until its frames are ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.proxy.auth import Auth, CallIds, Headers
from services.proxy.engine_client import Sampling
from services.proxy.openai_api import completion, empty_completion
from services.proxy.replies import ChatOutcome
from services.proxy.service import ProxyService
from services.proxy.settings import ProxySettings
from services.proxy.wire import Call, Wire
from shared import log
from shared.errors import ReinError

_log = log.get(__name__)
_TRUE = {"1", "true", "yes", "on"}


class ChatRoute:
    """The endpoints of one app's wire routes; each reads the lifespan's service from the request's state."""

    def __init__(self, settings: ProxySettings, auth: Auth) -> None:
        self.settings = settings
        self.auth = auth

    def by_headers(self, wire: Wire) -> Callable[[Request], Awaitable[Response]]:
        """``POST /v1/...``: the session named by headers or the API key."""
        async def endpoint(request: Request) -> Response:
            return await self.answer(request, self.auth.call_ids(Headers(request.scope["headers"])), wire)
        return endpoint

    def by_path(self, wire: Wire) -> Callable[[str, Request], Awaitable[Response]]:
        """``POST /sessions/{key}/v1/...``: the session named by the key in the path."""
        async def endpoint(key: str, request: Request) -> Response:
            ids = self.auth.call_ids(Headers(request.scope["headers"]), path_key=key)
            return await self.answer(request, ids, wire)
        return endpoint

    async def answer(self, request: Request, ids: CallIds, wire: Wire) -> Response:
        settings = self.settings
        service: ProxyService = request.state.service
        headers = Headers(request.scope["headers"])
        call = wire.call(await request.body())
        body = call.chat
        body.refuse_unsupported()
        soft = settings.soft_reject or headers.get(b"x-rein-soft-reject").strip().lower() in _TRUE
        sampling = Sampling(
            temperature=body.temperature if body.temperature is not None else settings.temperature,
            top_p=body.top_p if body.top_p is not None else 1.0,
            top_k=body.top_k if body.top_k is not None else -1,
            ignore_eos=body.ignore_eos,
            stop=body.stop_strings(),
        )
        chat = service.chat(
            ids, body.template_messages(), tools=body.template_tools(), budget=body.budget(settings.default_max_tokens),
            sampling=sampling, soft_reject=soft, calls=body.tool_calls(), force=body.force_call(),
        )
        model = body.model or settings.model_name
        if not body.stream:
            return JSONResponse(call.answer(_payload(model, await chat)))
        running = asyncio.ensure_future(chat)
        running.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if the client left
        done, _ = await asyncio.wait({running}, timeout=settings.stream_heartbeat_s)
        frames = call.frames(_payload(model, running.result())) if done else _heartbeats(
            running, model, settings.stream_heartbeat_s, call)
        return StreamingResponse(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _payload(model: str, outcome: ChatOutcome) -> dict[str, Any]:
    if outcome.soft_rejected:
        return empty_completion(model, outcome.rein)
    return completion(
        model=model, content=outcome.content, finish_reason=outcome.finish_reason,
        prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens, rein=outcome.rein,
        tool_calls=outcome.tool_calls, stop_sequence=outcome.stop_sequence, reasoning=outcome.reasoning,
    )


async def _heartbeats(running: asyncio.Future[ChatOutcome], model: str, every_s: float, call: Call,
                      ) -> AsyncIterator[str]:
    """SSE comments every ``every_s`` while the call runs, then its frames; an error becomes the wire's
    streamed error (the status is already 200). A client that leaves does not stop the call: the session
    still records and answers it whole."""
    while not running.done():
        yield ": keep-alive\n\n"
        await asyncio.wait({running}, timeout=every_s)
    error = running.exception()
    if error is None:
        for frame in call.frames(_payload(model, running.result())):
            yield frame
        return
    detail = error.detail() if isinstance(error, ReinError) else {"error": "internal", "message": type(error).__name__}
    if not isinstance(error, ReinError):
        _log.error("unhandled_error", path="chat", error=f"{type(error).__name__}: {error}", exc_info=error)
    yield call.error_frame(detail, error.status if isinstance(error, ReinError) else 500)
