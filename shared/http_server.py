"""What the HTTP services (engine, proxy) share: the body-size limit and the keep-alive rule.

:class:`BodyLimit` answers 413 for request bodies over a limit, declared or actually
sent; the body (at most ``max_bytes``) is read here and replayed to the app, so a
route never sees a partial body and a client cannot stream past the limit by lying
in Content-Length.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KEEP_ALIVE_S = 75
"""Servers keep idle connections longer than any client's pool expiry (httpx: 5 s), so the
client always closes first; equal timeouts race and a reused connection dies mid-request."""


def default_reject(max_bytes: int) -> Response:
    return JSONResponse({"detail": f"request body exceeds {max_bytes} bytes"}, status_code=413)


class BodyLimit:
    """413 (from ``reject(max_bytes)``) for bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int, reject: Callable[[int], Response] = default_reject) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.reject(self.max_bytes)(scope, receive, send)
            return
        parts: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await self.reject(self.max_bytes)(scope, receive, send)
                return
            parts.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
