"""Errors mapped to HTTP in one place, and requests counted by route.

Every :class:`shared.errors.ReinError` becomes its status and a body in the shape of the route's wire
(:attr:`Wire.error_body <services.proxy.wire.Wire.error_body>`; OpenAI's on ``/v1/models``, rein's
``{"detail": {...}}`` on its own routes; rein's detail is under ``detail`` on every one), validation
errors become 422 naming the field, anything else a logged 500. Metrics and logs name a request by its
route, read from the app's own routes (:class:`RouteLabels`), never by a path that holds a session key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import Counter
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.proxy.metrics import ProxyMetrics
from services.proxy.openai_api import error_body as openai_error_body
from services.proxy.routes import MODELS
from services.proxy.wires import WIRES
from shared import log
from shared.errors import InvalidRequest, PayloadTooLarge, ReinError, http_body

_log = log.get(__name__)
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


def unkeyed(path: str) -> str:
    """The route's path without the session's base URL before it (``/sessions/{key}/v1/...`` -> ``/v1/...``)."""
    if path.startswith("/sessions/") and "/v1/" in path:
        return path[path.index("/v1/"):]
    return path


class RouteLabels:
    """The route a path is for, as metrics and logs name it (``other`` when none): a session key in a path
    is never written out, a parameter of a route is written as the route declares it (``{id}``)."""

    def __init__(self, routes: Iterable[BaseRoute]) -> None:
        api = [route for route in routes if isinstance(route, APIRoute)]
        self._fixed = frozenset(route.path for route in api if not route.param_convertors)
        self._templated = [route for route in api if route.param_convertors]

    def __call__(self, path: str) -> str:
        path = unkeyed(path)
        if path in self._fixed:
            return path
        return next((route.path for route in self._templated if route.path_regex.match(path)), "other")


def error_response(path: str, error: ReinError, status: int | None = None) -> JSONResponse:
    """``error`` as the route at ``path`` answers one: in its wire's shape, rein's detail under ``detail``."""
    status = status or error.status
    route = unkeyed(path)
    wire = WIRES.get(route)
    if wire is not None:
        body = wire.error_body(error.detail(), status)
    elif route == MODELS:
        body = openai_error_body(error.detail(), status)
    else:
        body = http_body(error)
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI, label: RouteLabels) -> ErrorHandler:
    """Map every error to HTTP on ``app``; returns the ``ReinError`` handler, which the direct route uses too."""

    async def rein_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ReinError)
        if exc.status >= 500:
            _log.warning("request_failed", path=label(request.url.path), status=exc.status, error=exc.code,
                         message=exc.message)
        return error_response(request.url.path, exc)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        fields = [{"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"]} for err in exc.errors()]
        return error_response(request.url.path, InvalidRequest("invalid request", fields=fields))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        _log.error("unhandled_error", path=label(request.url.path), error=f"{type(exc).__name__}: {exc}",
                   exc_info=exc)
        return error_response(request.url.path, ReinError(f"internal error: {type(exc).__name__}"), 500)

    app.add_exception_handler(ReinError, rein_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
    return rein_error


def too_large(max_bytes: int, path: str) -> Response:
    return error_response(path, PayloadTooLarge(f"request body exceeds {max_bytes} bytes", max_bytes=max_bytes))


class RequestCounter:
    """Pure ASGI middleware: counts answered requests by route and status."""

    def __init__(self, app: ASGIApp, label: RouteLabels) -> None:
        self.app = app
        self.label = label
        self._counters: dict[tuple[str, int], Counter] = {}
        self._owner: ProxyMetrics | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        proxy_metrics: ProxyMetrics | None = scope.get("state", {}).get("metrics")
        route = self.label(scope.get("path", ""))

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and proxy_metrics is not None:
                if self._owner is not proxy_metrics:  # a new lifespan, a new registry
                    self._owner, self._counters = proxy_metrics, {}
                key = (route, message["status"])
                counter = self._counters.get(key)
                if counter is None:  # prometheus' labels() hashes and locks on every call; once per pair here
                    counter = self._counters[key] = proxy_metrics.requests.labels(route=route, status=str(key[1]))
                counter.inc()
            await send(message)

        await self.app(scope, receive, counting_send)
