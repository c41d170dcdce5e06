"""What the HTTP services (engine, proxy) share: the body-size limit, the keep-alive rule, a direct route,
FastAPI's options.

:class:`BodyLimit` answers 413 for request bodies over a limit, declared or actually
sent; the body (at most ``max_bytes``) is read here and replayed to the app, so a
route never sees a partial body and a client cannot stream past the limit by lying
in Content-Length. :class:`DirectRoute` takes one hot route past FastAPI's inner layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KEEP_ALIVE_S = 75
"""Servers keep idle connections longer than any client's pool expiry (httpx: 5 s), so the
client always closes first; equal timeouts race and a reused connection dies mid-request."""

APP_OPTIONS: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters else {}
)
"""FastAPI's native OpenTelemetry off where FastAPI has it (0.165 on): it looks up the global providers,
environment reads included, on every request, and rein exports no traces (2-3 % of the proxy's CPU, py-spy)."""


def default_reject(max_bytes: int, path: str) -> Response:
    return JSONResponse({"detail": f"request body exceeds {max_bytes} bytes"}, status_code=413)


class BodyLimit:
    """413 (from ``reject(max_bytes, path)``: the path picks the body's shape) for bodies over ``max_bytes``."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, reject: Callable[[int, str], Response] = default_reject
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.reject(self.max_bytes, scope.get("path", ""))(scope, receive, send)
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
                await self.reject(self.max_bytes, scope.get("path", ""))(scope, receive, send)
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


class DirectRoute:
    """``POST path`` answered by ``endpoint(request)`` right here; every other request goes on to the app.

    Why: between the user middleware and an endpoint, FastAPI runs its exception middleware, an
    exit stack, the router's match over every route, the route's request handler and its
    dependency solving; on the proxy's chat route that was about a tenth of the proxy's CPU
    (docs/benchmarks.md) for an endpoint that takes the bare :class:`Request` and returns a
    :class:`Response`. Added as the innermost middleware, so the outer ones (body limit,
    request counter, the 500 handler) still wrap it. An exception of a type in ``errors`` is
    answered by ``on_error`` (the app's handler for it); anything else propagates to the
    app's 500 handler, as from a routed endpoint. The route should stay registered on the
    app too (schema, other methods: 405).
    """

    def __init__(
        self,
        app: ASGIApp,
        path: str,
        endpoint: Callable[[Request], Awaitable[Response]],
        errors: tuple[type[Exception], ...],
        on_error: Callable[[Request, Exception], Awaitable[Response]],
    ) -> None:
        self.app = app
        self.path = path
        self.endpoint = endpoint
        self.errors = errors
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except self.errors as exc:
            response = await self.on_error(request, exc)
        await response(scope, receive, send)
