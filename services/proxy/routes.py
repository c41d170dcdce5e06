"""The proxy's own routes, everything but the wires: models, sessions, rollout control, health, metrics.

Who may call which is :mod:`services.proxy.auth`'s; what each does is :class:`ProxyService`'s. Bodies are
validated here (422 naming the field) and every route answers rein's ``{"detail": {...}}`` on error, but
``/v1/models``, which OpenAI's clients call and read in OpenAI's shape (:mod:`services.proxy.middleware`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from services.proxy.auth import Auth, Headers
from services.proxy.metrics import ProxyMetrics
from services.proxy.service import ProxyService
from services.proxy.session_keys import SessionKey, is_key
from services.proxy.settings import ProxySettings
from services.proxy.wire import parse
from shared import metrics
from shared.schemas import new_id

MODELS = "/v1/models"
"""OpenAI's model list: not a wire (no chat call), but its errors are in OpenAI's shape."""


class OpenSessionBody(BaseModel):
    """``POST /v1/sessions``: what a black-box agent's calls will be recorded as (``X-Group-Id`` etc.)."""

    model_config = ConfigDict(extra="forbid")
    group_id: str = Field(min_length=1, max_length=256)
    prompt_id: str = Field(default="", max_length=256)
    attempt: int = Field(default=0, ge=0)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    """Absent: a fresh id."""


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


def add_own_routes(app: FastAPI, settings: ProxySettings, auth: Auth) -> None:
    """Route ``app``'s own requests; each reads the lifespan's service (and metrics) from the request's state."""

    @app.get(MODELS)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                             "owned_by": "rein"}]}

    @app.get(f"/sessions/{{key}}{MODELS}")
    async def models_by_path(key: str) -> dict[str, Any]:
        auth.session_key(key)
        return await models()

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> dict[str, Any]:
        """A session for an agent that sets only a base URL and an API key (docs/agents.md); the runner's."""
        auth.require_runner(Headers(request.scope["headers"]), "opening a session")
        body = parse(OpenSessionBody, await request.body())
        ids = SessionKey(body.session_id or new_id("session"), body.group_id, body.prompt_id, body.attempt)
        key = auth.mint(ids)
        root = f"{str(request.base_url).rstrip('/')}/sessions/{key}"
        return {"session_id": ids.session_id, "group_id": ids.group_id, "prompt_id": ids.prompt_id,
                "attempt": ids.attempt, "api_key": key, "base_url": f"{root}/v1",
                "anthropic_base_url": root}  # Anthropic's clients add /v1 themselves

    @app.post("/v1/sessions/{id}/finish")  # {id}: the route's label in metrics and logs, as the docs write it
    async def finish(id: str, request: Request) -> dict[str, Any]:
        """The session's end and reward, the runner's alone; ``id`` is the session's id or its key."""
        auth.require_runner(Headers(request.scope["headers"]), "finishing a session")
        service: ProxyService = request.state.service
        session_id = auth.session_key(id).session_id if is_key(id) else id
        body = parse(FinishBody, await request.body())
        return await service.finish(session_id, body.reward, body.status, body.error)

    @app.post("/v1/rollout/pause")
    async def pause(request: Request) -> dict[str, Any]:
        auth.require_admin(Headers(request.scope["headers"]))
        service: ProxyService = request.state.service
        body = parse(PauseBody, await request.body(), empty_ok=True)
        return await service.pause(body.reason, body.timeout_s, body.pause_id, body.lease_s)

    @app.post("/v1/rollout/renew")
    async def renew(request: Request) -> dict[str, Any]:
        auth.require_admin(Headers(request.scope["headers"]))
        service: ProxyService = request.state.service
        body = parse(RenewBody, await request.body())
        return service.renew(body.pause_id, body.lease_s)

    @app.post("/v1/rollout/resume")
    async def resume(request: Request) -> dict[str, Any]:
        auth.require_admin(Headers(request.scope["headers"]))
        service: ProxyService = request.state.service
        body = parse(ResumeBody, await request.body(), empty_ok=True)
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
