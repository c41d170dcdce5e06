"""Fronts put between a proxy and a real engine (served with ``tests.support.proxy.ServerThread``), for the
proxy tests that need an engine to answer in a way the engine alone will not on cue:

- :class:`NaturalStopShim`: a generation that has already ended on its own when the pause's abort for it
  arrives.
- :class:`CountingFront`: every call counted by path; optionally without rein's bulk ``/abort_requests``,
  as SGLang has none.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class NaturalStopShim:
    """A front for the engine that holds each /generate answer until an abort for it arrived,
    and answers every abort 200 like SGLang does, whether or not the request still runs: so the
    abort a pause sends reaches a generation that already finished by itself, and the proxy must
    keep that answer as it is rather than count it preempted and continue it."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.generated = threading.Event()
        self.generate_calls = 0
        self.aborts: list[str] = []
        self._abort_seen = asyncio.Event()
        self.app = Starlette(
            routes=[
                Route("/generate", self.generate, methods=["POST"]),
                Route("/abort_request", self.abort, methods=["POST"]),
                Route("/get_model_info", self.forward_get, methods=["GET"]),
                Route("/get_server_info", self.forward_get, methods=["GET"]),
            ]
        )

    async def generate(self, request: Request) -> JSONResponse:
        self.generate_calls += 1
        async with httpx.AsyncClient(timeout=60) as client:
            answer = (await client.post(f"{self.engine_url}/generate", json=await request.json())).json()
        self.generated.set()
        await asyncio.wait_for(self._abort_seen.wait(), 30)
        return JSONResponse(answer)

    async def abort(self, request: Request) -> JSONResponse:
        self.aborts.append((await request.json())["rid"])
        self._abort_seen.set()
        return JSONResponse({})

    async def forward_get(self, request: Request) -> JSONResponse:
        async with httpx.AsyncClient(timeout=10) as client:
            return JSONResponse((await client.get(f"{self.engine_url}{request.url.path}")).json())


class CountingFront:
    """Forwards every call to the real engine and counts them by path. ``bulk=False`` hides rein's
    ``/abort_requests`` (404, as SGLang, which has no such route)."""

    def __init__(self, engine_url: str, bulk: bool) -> None:
        self.engine_url = engine_url
        self.bulk = bulk
        self.calls: dict[str, int] = {}
        self.app = Starlette(
            routes=[Route(p, self.post, methods=["POST"]) for p in ("/generate", "/abort_request", "/abort_requests")]
            + [Route(p, self.get, methods=["GET"]) for p in ("/get_model_info", "/get_server_info")]
        )

    async def post(self, request: Request) -> JSONResponse:
        path = request.url.path
        self.calls[path] = self.calls.get(path, 0) + 1
        if path == "/abort_requests" and not self.bulk:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(f"{self.engine_url}{path}", json=await request.json())
        return JSONResponse(answer.json(), status_code=answer.status_code)

    async def get(self, request: Request) -> JSONResponse:
        async with httpx.AsyncClient(timeout=10) as client:
            return JSONResponse((await client.get(f"{self.engine_url}{request.url.path}")).json())
