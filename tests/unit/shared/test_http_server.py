"""DirectRoute in-process (TestClient): which requests it answers, and how its errors come out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.http_server import BodyLimit, DirectRoute


class Refused(Exception):
    pass


class Seen:
    """Outer middleware: records the status of every answer it passes on."""

    statuses: list[int]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def seen(message: Message) -> None:
            if message["type"] == "http.response.start":
                Seen.statuses.append(message["status"])
            await send(message)

        await self.app(scope, receive, seen)


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = FastAPI()

    async def direct(request: Request) -> Response:
        body = await request.body()
        if body == b"refuse":
            raise Refused("no")
        if body == b"crash":
            raise RuntimeError("bug")
        return JSONResponse({"via": "direct", "body": body.decode()})

    @app.post("/hot")
    async def routed(_: Request) -> dict[str, str]:
        return {"via": "router"}

    @app.post("/cold")
    async def cold(_: Request) -> dict[str, str]:
        return {"via": "router"}

    async def refused(_: Request, exc: Exception) -> Response:
        return JSONResponse({"refused": str(exc)}, status_code=409)

    async def crashed(_: Request, exc: Exception) -> Response:
        return JSONResponse({"error": type(exc).__name__}, status_code=500)

    app.add_exception_handler(Exception, crashed)
    app.add_middleware(DirectRoute, path="/hot", endpoint=direct, errors=(Refused,), on_error=refused)
    app.add_middleware(BodyLimit, max_bytes=16)
    app.add_middleware(Seen)
    Seen.statuses = []
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_post_on_the_path_is_answered_directly_with_the_body(client: TestClient) -> None:
    r = client.post("/hot", content=b"hello")
    assert r.status_code == 200 and r.json() == {"via": "direct", "body": "hello"}
    assert Seen.statuses == [200]  # the outer middleware still wraps it


def test_other_paths_and_methods_go_to_the_app(client: TestClient) -> None:
    assert client.post("/cold", content=b"x").json() == {"via": "router"}
    assert client.get("/hot").status_code == 405
    assert client.post("/nowhere").status_code == 404


def test_listed_errors_get_their_handler_others_the_apps_500(client: TestClient) -> None:
    r = client.post("/hot", content=b"refuse")
    assert r.status_code == 409 and r.json() == {"refused": "no"}
    r = client.post("/hot", content=b"crash")
    assert r.status_code == 500 and r.json() == {"error": "RuntimeError"}


def test_outer_body_limit_still_applies(client: TestClient) -> None:
    assert client.post("/hot", content=b"x" * 17).status_code == 413
