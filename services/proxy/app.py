"""HTTP shell of the proxy: ``create_app(settings) -> FastAPI``.

Reads like a table of contents: the lifespan builds the engine connection pools, the engine
pool (fixed and registered engines, watched for health), the Kafka publisher, the pause controller
and the :class:`ProxyService` (no module globals; each app instance owns its own). Routes parse HTTP and call
the service; the chat route, the hot one, is answered by a :class:`~shared.http_server.DirectRoute`
past FastAPI's per-route layers. Errors are mapped to HTTP in one place (:func:`_install_error_handlers`,
whose ``ReinError`` handler the direct route uses too):
every :class:`shared.errors.ReinError` becomes its status and a body in the shape of the route's wire
(OpenAI's ``{"error": {...}}`` on chat, Responses and models, Anthropic's ``{"type": "error", ...}`` on
Messages, rein's ``{"detail": {...}}`` on its own routes; rein's detail is under ``detail`` on every one),
validation errors become 422 naming the field, anything else a logged 500.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple, TypeVar

import httpcore
import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.proxy import messages_api, responses_api
from services.proxy.auth import Auth, CallIds, Headers
from services.proxy.engine_client import EngineHandle, NetworkBackend, Sampling
from services.proxy.engine_pool import EnginePool
from services.proxy.generation import PauseController
from services.proxy.membership import Membership
from services.proxy.metrics import ProxyMetrics
from services.proxy.openai_api import (
    ChatRequest,
    FinishBody,
    OpenSessionBody,
    PauseBody,
    RenewBody,
    ResumeBody,
    completion,
    empty_completion,
    sse_error_frame,
    sse_frames,
)
from services.proxy.openai_api import error_body as openai_error_body
from services.proxy.publisher import Publisher
from services.proxy.service import ProxyService
from services.proxy.session_keys import KeySigner, SessionKey, is_key
from services.proxy.session_machine import ChatOutcome
from services.proxy.settings import ProxySettings
from shared import log, metrics
from shared.errors import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    PayloadTooLarge,
    ReinError,
    http_body,
)
from shared.http_server import BodyLimit, DirectRoute
from shared.lender import Lender
from shared.members import Members
from shared.model import load_tokenizer
from shared.names import RedisKeys
from shared.schemas import new_id
from shared.state import connect

_log = log.get(__name__)
B = TypeVar("B", bound=BaseModel)
_TRUE = {"1", "true", "yes", "on"}


def create_app(settings: ProxySettings) -> FastAPI:
    tokenizer = load_tokenizer(settings.model)  # REIN_MODEL's chat template; no weights (for tiny, no torch)
    auth = Auth(settings.admin_token, settings.runner_token, settings.open_sessions,
                KeySigner(settings.session_key_secret, settings.run_id, settings.session_key_ttl_s))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, Any]]:
        registry = CollectorRegistry(auto_describe=True)
        proxy_metrics = ProxyMetrics(registry)
        timeouts = {"connect": settings.engine_connect_timeout_s, "read": settings.engine_timeout_s,
                    "write": settings.engine_timeout_s, "pool": settings.engine_timeout_s}
        tls = httpx.create_ssl_context()  # one for every pool: each would load the CA bundle (~50 ms)
        backend = NetworkBackend()
        keepalive = len(settings.engine_urls) + (8 if settings.discover_engines else 0)
        clients = Lender(lambda: httpcore.AsyncConnectionPool(
            ssl_context=tls, max_connections=None, max_keepalive_connections=max(1, keepalive),
            keepalive_expiry=5.0, network_backend=backend,
        ))

        def handle(url: str) -> EngineHandle:
            return EngineHandle(url, clients, settings.context_window, settings.engine_connect_timeout_s, timeouts)

        redis_client = None
        try:
            members = None
            # One Redis client for the registered engines and this proxy's own registration. Unreachable: the
            # proxy does not start (StateUnavailable says why): it could route nowhere, or not be found to pause.
            if settings.discover_engines or settings.advertise_url:
                redis_client = await asyncio.to_thread(connect, settings.redis)
            if settings.discover_engines and redis_client is not None:
                members = Members(redis_client, RedisKeys(settings.redis.key_prefix), "engine")
            engines = EnginePool([handle(url) for url in settings.engine_urls], handle, members,
                                 settings.engine_unhealthy_after)
            for engine in engines.all():
                try:
                    await engine.refresh()
                except (EngineUnavailable, EngineError) as exc:
                    _log.warning("engine_info_unavailable_at_start", engine=engine.url, error=str(exc))
            if members is not None:
                await engines.check()  # the registered engines take sessions from the first call on
            publisher = Publisher(settings.kafka, settings.publish_max_inflight_bytes, proxy_metrics)
            await publisher.start()
            service = ProxyService(settings, engines, publisher, PauseController(), proxy_metrics, tokenizer)
            _log.info("proxy ready", engines=[(e.url, e.version) for e in engines.all()],
                      discover_engines=settings.discover_engines,
                      partial_rollout=settings.partial_rollout, max_preempts=settings.max_preempts)
            tasks = [asyncio.create_task(_expire_idle_sessions(service)),
                     asyncio.create_task(_expire_pause_leases(service)),
                     asyncio.create_task(engines.watch(settings.engine_health_interval_s))]
            membership = None
            try:
                if settings.advertise_url and redis_client is not None:
                    membership = await Membership.start(settings, service, redis_client)
                yield {"service": service, "metrics": proxy_metrics}
            finally:
                if membership is not None:
                    await membership.stop()
                for task in tasks:
                    task.cancel()
                service.controller.resume()  # release held calls so shutdown does not hang on them
                await publisher.close()
        finally:
            if redis_client is not None:
                redis_client.close()
            for client in clients.items:
                await client.aclose()

    app = FastAPI(title="rein proxy", lifespan=lifespan)
    _install_error_handlers(app)

    def by_headers(wire: Callable[[bytes], _Call]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await _chat(request, auth.call_ids(Headers(request.scope["headers"])), wire)
        return endpoint

    def by_path(wire: Callable[[bytes], _Call]) -> Callable[[str, Request], Awaitable[Response]]:
        async def endpoint(key: str, request: Request) -> Response:
            return await _chat(request, auth.call_ids(Headers(request.scope["headers"]), path_key=key), wire)
        return endpoint

    # Chat Completions, and the Responses and Messages wires as thin adapters onto the same call
    # (docs/agents.md, "Other wires"); each by headers or API key, and by a session key in the path.
    chat_completions = by_headers(_chat_wire)
    for path, wire in (("chat/completions", _chat_wire), ("responses", _responses_wire), ("messages", _messages_wire)):
        app.add_api_route(f"/v1/{path}", chat_completions if wire is _chat_wire else by_headers(wire), methods=["POST"])
        app.add_api_route(f"/sessions/{{key}}/v1/{path}", by_path(wire), methods=["POST"])

    async def _chat(request: Request, ids: CallIds, wire: Callable[[bytes], _Call]) -> Response:
        service: ProxyService = request.state.service
        headers = Headers(request.scope["headers"])
        call = wire(await request.body())
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
        # A streamed call answered within one heartbeat gets its real status, errors included; a longer
        # one commits to 200 and keeps the connection alive until its frames (or its error) are ready.
        running = asyncio.ensure_future(chat)
        running.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if the client left
        done, _ = await asyncio.wait({running}, timeout=settings.stream_heartbeat_s)
        frames = call.frames(_payload(model, running.result())) if done else _heartbeats(
            running, model, settings.stream_heartbeat_s, call)
        return StreamingResponse(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                             "owned_by": "rein"}]}

    @app.get("/sessions/{key}/v1/models")
    async def models_by_path(key: str) -> dict[str, Any]:
        auth.session_key(key)
        return await models()

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> dict[str, Any]:
        """A session for an agent that sets only a base URL and an API key (docs/agents.md); the runner's."""
        auth.require_runner(Headers(request.scope["headers"]), "opening a session")
        body = _parse(OpenSessionBody, await request.body())
        ids = SessionKey(body.session_id or new_id("session"), body.group_id, body.prompt_id, body.attempt)
        key = auth.mint(ids)
        root = f"{str(request.base_url).rstrip('/')}/sessions/{key}"
        return {"session_id": ids.session_id, "group_id": ids.group_id, "prompt_id": ids.prompt_id,
                "attempt": ids.attempt, "api_key": key, "base_url": f"{root}/v1",
                "anthropic_base_url": root}  # Anthropic's clients add /v1 themselves

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        """The session's end and reward, the runner's alone; ``session_id`` may be the session's key."""
        auth.require_runner(Headers(request.scope["headers"]), "finishing a session")
        service: ProxyService = request.state.service
        if is_key(session_id):
            session_id = auth.session_key(session_id).session_id
        body = _parse(FinishBody, await request.body())
        return await service.finish(session_id, body.reward, body.status, body.error)

    @app.post("/v1/rollout/pause")
    async def pause(request: Request) -> dict[str, Any]:
        auth.require_admin(Headers(request.scope["headers"]))
        service: ProxyService = request.state.service
        body = _parse(PauseBody, await request.body(), empty_ok=True)
        return await service.pause(body.reason, body.timeout_s, body.pause_id, body.lease_s)

    @app.post("/v1/rollout/renew")
    async def renew(request: Request) -> dict[str, Any]:
        auth.require_admin(Headers(request.scope["headers"]))
        service: ProxyService = request.state.service
        body = _parse(RenewBody, await request.body())
        return service.renew(body.pause_id, body.lease_s)

    @app.post("/v1/rollout/resume")
    async def resume(request: Request) -> dict[str, Any]:
        auth.require_admin(Headers(request.scope["headers"]))
        service: ProxyService = request.state.service
        body = _parse(ResumeBody, await request.body(), empty_ok=True)
        return await service.resume(body.version, body.pause_id)

    @app.get("/v1/rollout/state")
    async def rollout_state(request: Request) -> dict[str, Any]:
        auth.require_admin(Headers(request.scope["headers"]))
        service: ProxyService = request.state.service
        return service.state()

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        service: ProxyService = request.state.service
        return {"status": "ok", "paused": service.controller.paused}

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        service: ProxyService = request.state.service
        proxy_metrics: ProxyMetrics = request.state.metrics
        proxy_metrics.paused.set(1 if service.controller.paused else 0)
        proxy_metrics.held.set(service.controller.held)
        proxy_metrics.active.set(len(service.controller.active()))
        body, content_type = metrics.render(proxy_metrics.registry)
        return Response(body, media_type=content_type)

    # the chat route, routed above as well, is answered past FastAPI's per-route layers (inside these two)
    app.add_middleware(DirectRoute, path="/v1/chat/completions", endpoint=chat_completions, errors=(ReinError,),
                       on_error=_rein_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, reject=_too_large)
    app.add_middleware(RequestCounter)
    return app


# --------------------------------------------------------------------------- request parsing


async def _expire_pause_leases(service: ProxyService) -> None:
    """End a pause whose lease ran out (checked every 0.1 s while paused, every 0.5 s otherwise)."""
    while True:
        left = service.controller.lease_left_s()
        await asyncio.sleep(0.5 if left is None else min(max(left, 0.0) + 0.01, 0.1))
        try:
            await service.expire_lease()
        except Exception:  # a bug here must not end the watch, nor the proxy
            _log.exception("lease_watch_failed")


async def _expire_idle_sessions(service: ProxyService) -> None:
    """Sweep for idle sessions a few times per idle timeout (at least every 30 s) until cancelled."""
    timeout = service.settings.session_idle_timeout_s
    if not timeout:
        return
    interval = min(timeout / 4, 30.0)
    while True:
        await asyncio.sleep(interval)
        try:
            await service.expire_idle()
        except Exception:  # a bug here must not end the sweeps, nor the proxy
            _log.exception("idle_sweep_failed")


class _Call(NamedTuple):
    """One chat call as a wire speaks it: the chat-completions request it asks for, and how the finished
    ``chat.completion`` body is answered whole, streamed, or (after the stream began) failed."""

    chat: ChatRequest
    answer: Callable[[dict[str, Any]], dict[str, Any]]
    frames: Callable[[dict[str, Any]], Iterator[str]]
    error_frame: Callable[[dict[str, Any], int], str]
    """rein's detail of the error and its HTTP status (which the stream, already 200, can no longer carry)."""


def _chat_wire(raw: bytes) -> _Call:
    request = _parse(ChatRequest, raw)
    usage = bool((request.stream_options or {}).get("include_usage"))
    return _Call(request, lambda body: body, lambda body: sse_frames(body, usage), sse_error_frame)


def _responses_wire(raw: bytes) -> _Call:
    request = _parse(responses_api.ResponsesRequest, raw)
    return _Call(_validate(ChatRequest, responses_api.to_chat(request)),
                 lambda body: responses_api.answer(body, request), lambda body: responses_api.events(body, request),
                 lambda detail, _status: responses_api.failed_events(detail, request))


def _messages_wire(raw: bytes) -> _Call:
    request = _parse(messages_api.MessagesRequest, raw)
    return _Call(_validate(ChatRequest, messages_api.to_chat(request)), messages_api.answer, messages_api.events,
                 messages_api.error_event)


def _parse(model: type[B], raw: bytes, empty_ok: bool = False) -> B:
    """Validate a JSON body; 422 naming each bad field."""
    if empty_ok and not raw.strip():
        return model.model_validate({})
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        fields = [{"field": "body", "message": str(exc)}]
        raise InvalidRequest(f"body is not valid JSON: {exc}", fields=fields) from None
    return _validate(model, data)


def _validate(model: type[B], data: Any) -> B:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        fields = [{"field": ".".join(str(p) for p in err["loc"]) or "body", "message": err["msg"]}
                  for err in exc.errors()]
        names = ", ".join(f["field"] for f in fields)
        raise InvalidRequest(f"invalid request body: {names}", fields=fields) from None


# --------------------------------------------------------------------------- errors and middleware


def _payload(model: str, outcome: ChatOutcome) -> dict[str, Any]:
    if outcome.soft_rejected:
        return empty_completion(model, outcome.rein)
    return completion(
        model=model, content=outcome.content, finish_reason=outcome.finish_reason,
        prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens, rein=outcome.rein,
        tool_calls=outcome.tool_calls, stop_sequence=outcome.stop_sequence, reasoning=outcome.reasoning,
    )


async def _heartbeats(running: asyncio.Future[ChatOutcome], model: str, every_s: float, call: _Call,
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


async def _rein_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ReinError)
    if exc.status >= 500:
        _log.warning("request_failed", path=_route_label(request.url.path), status=exc.status, error=exc.code,
                     message=exc.message)
    return _error(request.url.path, exc)


_OPENAI_ROUTES = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/models"})


def _error(path: str, error: ReinError, status: int | None = None) -> JSONResponse:
    """``error`` as the route at ``path`` answers one: in its wire's shape, rein's detail under ``detail``."""
    status = status or error.status
    route = _route_label(path)
    if route == "/v1/messages":
        body = messages_api.error_body(error.detail(), status)
    elif route in _OPENAI_ROUTES:
        body = openai_error_body(error.detail(), status)
    else:
        body = http_body(error)
    return JSONResponse(body, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        fields = [{"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"]} for err in exc.errors()]
        return _error(request.url.path, InvalidRequest("invalid request", fields=fields))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        _log.error("unhandled_error", path=_route_label(request.url.path), error=f"{type(exc).__name__}: {exc}",
                   exc_info=exc)
        return _error(request.url.path, ReinError(f"internal error: {type(exc).__name__}"), 500)

    app.add_exception_handler(ReinError, _rein_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


def _too_large(max_bytes: int, path: str) -> Response:
    return _error(path, PayloadTooLarge(f"request body exceeds {max_bytes} bytes", max_bytes=max_bytes))


_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models", "/v1/sessions", "/v1/rollout/pause",
    "/v1/rollout/renew", "/v1/rollout/resume", "/v1/rollout/state", "/health", "/metrics",
})


def _route_label(path: str) -> str:
    """The route a path is for, as metrics and logs name it: a session key in a path is never written out."""
    if path.startswith("/sessions/") and "/v1/" in path:  # the same routes under a session's base URL
        path = path[path.index("/v1/"):]
    if path in _ROUTES:
        return path
    if path.startswith("/v1/sessions/") and path.endswith("/finish"):
        return "/v1/sessions/{id}/finish"
    return "other"


class RequestCounter:
    """Pure ASGI middleware: counts answered requests by route and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._counters: dict[tuple[str, int], Counter] = {}
        self._owner: ProxyMetrics | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        proxy_metrics: ProxyMetrics | None = scope.get("state", {}).get("metrics")
        route = _route_label(scope.get("path", ""))

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
