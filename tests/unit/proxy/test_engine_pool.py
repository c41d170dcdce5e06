"""The proxy's engine pool around the pure table: registered engines join after they answered, and an
engine that leaves or fails has its calls in flight cut, so no session waits on a dead engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from services.proxy.engine_client import EngineHandle, Sampling
from services.proxy.engine_pool import EnginePool
from services.proxy.session_machine import Session
from shared.errors import EngineLost, EngineUnavailable
from shared.http_client import HttpClient, Response, Unreachable
from shared.lender import Lender

INFO = {"weight_version": "v3", "context_length": 64, "max_req_input_len": 64}


class HangingEngine(HttpClient):
    """Answers the info and health routes; never answers ``/generate`` (a hung engine)."""

    def __init__(self) -> None:
        super().__init__("http://e")

    async def request(self, method: str, path: str, body: bytes | None = None, *, timeout_s: float | None = None,
                      headers: Any = None) -> Response:
        if path == "/generate":
            await asyncio.Event().wait()
        return Response(200, json.dumps(INFO).encode())


class Registered:
    """The registered engines as the pool reads them (``live`` is what Redis answers now)."""

    def __init__(self, *urls: str) -> None:
        self.urls = list(urls)

    def live(self) -> list[str]:
        return list(self.urls)


def pool(members: Registered) -> EnginePool:
    def handle(url: str) -> EngineHandle:
        return EngineHandle(url, Lender(HangingEngine), None)

    return EnginePool([], handle, members, unhealthy_after=2)  # type: ignore[arg-type]


def test_a_registered_engine_joins_once_it_answered_and_its_calls_are_cut_when_it_leaves() -> None:
    async def scenario() -> None:
        members = Registered("http://e1")
        engines = pool(members)
        await engines.check()
        session = Session("s", "g")
        engine = engines.route(session)
        assert (engine.url, engine.version, engine.context_window) == ("http://e1", "v3", 64)
        assert session.engine == "http://e1" and engines.standing("http://e1")["sessions"] == 1
        call = asyncio.create_task(engine.generate("r", [1], 4, Sampling(1.0), []))
        await asyncio.sleep(0.05)
        members.urls = []  # its registration lapsed (a dead engine may lapse before its checks fail)
        await engines.check()
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(call, 5)
        session.num_chunks = 1  # it holds tokens of e1
        with pytest.raises(EngineLost, match="left the registry"):
            engines.route(session)
        engines.release(session)
        assert engines.standing("http://e1")["sessions"] == 0

    asyncio.run(scenario())


def test_failed_calls_take_an_engine_out_and_lose_the_sessions_holding_its_tokens() -> None:
    async def scenario() -> None:
        engines = pool(Registered("http://e1", "http://e2"))
        await engines.check()
        fresh, holding = Session("fresh", "g"), Session("holding", "g")
        url = engines.route(holding).url
        holding.num_chunks = 2
        error = EngineUnavailable("refused", engine=url)
        assert engines.call_failed(holding, error) is error, "one failure does not take it out"
        lost = engines.call_failed(holding, error)
        assert isinstance(lost, EngineLost) and lost.fields["engine"] == url
        assert engines.route(fresh).url != url, "a new session starts on the other engine"
        engines.answered(url)
        assert url in [e.url for e in engines.routable()], "one good check brings it back"

    asyncio.run(scenario())


class SilentEngine(HttpClient):
    """Refuses every call (registered, but not answering)."""

    def __init__(self) -> None:
        super().__init__("http://e")

    async def request(self, method: str, path: str, body: bytes | None = None, *, timeout_s: float | None = None,
                      headers: Any = None) -> Response:
        raise Unreachable("refused")


def test_a_registered_engine_that_never_answered_gets_no_sessions_and_is_shown_as_not_admitted() -> None:
    async def scenario() -> None:
        engines = EnginePool([], lambda url: EngineHandle(url, Lender(SilentEngine), None),
                             Registered("http://e9"))  # type: ignore[arg-type]
        await engines.check()
        assert [e.url for e in engines.all()] == ["http://e9"] and engines.routable() == []
        assert engines.standing("http://e9") == {"healthy": False, "fixed": False, "registered": False,
                                                 "sessions": 0}
        with pytest.raises(EngineUnavailable, match="no healthy engine"):
            engines.route(Session("s", "g"))

    asyncio.run(scenario())
