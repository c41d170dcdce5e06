"""EngineHandle reads SGLang's info routes: the version from /get_model_info, the window from
/get_server_info (or the settings), extra fields tolerated, missing ones a clear 502."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from services.proxy.engine_client import EngineHandle, Sampling, context_window_of
from shared.errors import EngineError, EngineUnavailable
from shared.http_client import HttpClient, Response
from shared.lender import Lender

SGLANG_MODEL_INFO = {"model_path": "/m", "tokenizer_path": "/m", "is_generation": True,
                     "preferred_sampling_params": None, "weight_version": "default"}


class InMemoryEngine(HttpClient):
    """A client that answers ``routes`` (path -> JSON body; absent: 404) without a socket."""

    def __init__(self, routes: dict[str, Any]) -> None:
        super().__init__("http://e")
        self.routes = routes
        self.seen: list[str] = []

    async def request(self, method: str, path: str, body: bytes | None = None, *, timeout_s: float | None = None,
                      headers: Any = None) -> Response:
        self.seen.append(path)
        if path not in self.routes:
            return Response(404, json.dumps({"detail": "Not Found"}).encode())
        return Response(200, json.dumps(self.routes[path]).encode())


def handle(routes: dict[str, Any], window: int | None = None) -> tuple[EngineHandle, list[str]]:
    """A handle on an in-memory engine answering ``routes``."""
    engine = InMemoryEngine(routes)
    return EngineHandle("http://e", Lender(lambda: engine), window), engine.seen


@pytest.mark.parametrize(
    ("info", "window"),
    [
        ({"context_length": None, "max_req_input_len": 32757, "tp_size": 1}, 32757),  # SGLang's default launch
        ({"context_length": 4096, "max_req_input_len": 4090}, 4090),
        ({"context_length": 64, "max_req_input_len": 64}, 64),  # rein's engine
        ({"context_length": 2048}, 2048),
        ({"context_length": True, "max_req_input_len": 100}, 100),  # a bool is not a length
    ],
)
def test_context_window_of(info: dict[str, Any], window: int) -> None:
    assert context_window_of(info, "http://e") == window


@pytest.mark.parametrize("info", [{}, {"context_length": None}, {"max_req_input_len": 1}, [], None])
def test_context_window_of_refuses_what_has_none(info: Any) -> None:
    with pytest.raises(EngineError, match=r"no usable context window.*REIN_CONTEXT_WINDOW"):
        context_window_of(info, "http://e")


def test_refresh_reads_both_sglang_routes() -> None:
    engine, seen = handle({"/get_model_info": SGLANG_MODEL_INFO,
                           "/get_server_info": {"context_length": None, "max_req_input_len": 500}})
    assert asyncio.run(engine.window()) == 500
    assert engine.version == "default" and seen == ["/get_model_info", "/get_server_info"]
    asyncio.run(engine.refresh())  # the window is read once; the version every time
    assert seen[2:] == ["/get_model_info"]


def test_a_configured_window_is_not_read() -> None:
    engine, seen = handle({"/get_model_info": {**SGLANG_MODEL_INFO, "weight_version": "v3", "digest": "x"}}, 128)
    asyncio.run(engine.refresh())
    assert (engine.version, asyncio.run(engine.window()), seen) == ("v3", 128, ["/get_model_info"])


def test_missing_fields_and_routes_are_clear_errors() -> None:
    no_version, _ = handle({"/get_model_info": {"model_path": "/m"}}, 128)
    with pytest.raises(EngineError, match="without weight_version"):
        asyncio.run(no_version.refresh())
    no_server_info, _ = handle({"/get_model_info": SGLANG_MODEL_INFO})
    with pytest.raises(EngineError, match="404 on /get_server_info"):
        asyncio.run(no_server_info.window())


class StatusEngine(HttpClient):
    """Answers every call with ``status``, or never (``status`` None: a hung engine)."""

    def __init__(self, status: int | None) -> None:
        super().__init__("http://e")
        self.status = status

    async def request(self, method: str, path: str, body: bytes | None = None, *, timeout_s: float | None = None,
                      headers: Any = None) -> Response:
        if self.status is None:
            await asyncio.Event().wait()
        return Response(self.status or 200, b"{}")


@pytest.mark.parametrize(("status", "up"), [(200, True), (404, True), (405, True), (503, False), (500, False)])
def test_health_is_any_answer_but_a_server_error(status: int, up: bool) -> None:
    """SGLang and rein's engine serve ``/health``; a server without it (4xx) still answered: it is up."""
    engine = EngineHandle("http://e", Lender(lambda: StatusEngine(status)), 64)
    if up:
        asyncio.run(engine.check())
    else:
        with pytest.raises(EngineError, match=f"answered {status} on /health"):
            asyncio.run(engine.check())


def test_cut_ends_the_calls_in_flight_at_once_as_engine_unavailable() -> None:
    """A hung engine never answers: :meth:`EngineHandle.cut` (its health checks failed) ends the wait."""
    engine = EngineHandle("http://e", Lender(lambda: StatusEngine(None)), 64)

    async def scenario() -> float:
        calls = [asyncio.create_task(engine.generate(f"r{i}", [1, 2], 4, Sampling(1.0), [])) for i in range(2)]
        await asyncio.sleep(0.05)
        assert not any(c.done() for c in calls)
        loop = asyncio.get_running_loop()
        started = loop.time()
        engine.cut()
        for call in calls:
            with pytest.raises(EngineUnavailable, match="failed its health checks"):
                await asyncio.wait_for(call, 5)
        engine.cut()  # nothing in flight: nothing happens
        return loop.time() - started

    assert asyncio.run(scenario()) < 1.0
