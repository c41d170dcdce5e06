"""shared.http_client against loopback servers that misbehave on purpose, on asyncio's loop and on uvloop
(the rollout runner's): kept-alive reuse, a server's close seen before reuse, framing, bounds, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

from ops.local.ports import free_port
from shared.http_client import HttpClient, Response, Timeout, Unreachable

T = TypeVar("T")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

LOOPS = ["asyncio", "uvloop"]


def run(loop: str, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the named event loop, bounded."""
    bounded = asyncio.wait_for(coro, 20)
    if loop == "uvloop":
        return uvloop.run(bounded)
    return asyncio.run(bounded)


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (by its Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


class Server:
    """A loopback server running ``handler`` for each connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request on the connection with its method, path and body."""
    while True:
        head, body = await read_request(reader)
        first = head.split(b"\r\n", 1)[0]
        writer.write(ok(first + b"|" + body))
        await writer.drain()


@pytest.mark.parametrize("loop", LOOPS)
def test_calls_reuse_one_kept_alive_connection_and_carry_headers_and_body(loop: str) -> None:
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            heads.append(head)
            writer.write(ok(body or b"-"))
            await writer.drain()

    async def go() -> tuple[list[Response], int, int]:
        server = Server(handler)
        async with server as url:
            client = HttpClient(url + "/base", {"Authorization": "Bearer k"})
            got = [await client.request("POST", "/x", b'{"a":1}', headers={"X-Extra": "1"}),
                   await client.request("GET", "/y")]
            await client.aclose()
            return got, server.connections, client.connections

    got, served, opened = run(loop, go())
    assert [(r.status, r.content) for r in got] == [(200, b'{"a":1}'), (200, b"-")]
    assert (served, opened) == (1, 1)
    assert heads[0].startswith(b"POST /base/x HTTP/1.1\r\n")
    assert b"Authorization: Bearer k\r\n" in heads[0] and b"X-Extra: 1\r\n" in heads[0]
    assert b"Content-Length: 7\r\n" in heads[0] and b"Host: 127.0.0.1:" in heads[0]
    assert heads[1].startswith(b"GET /base/y HTTP/1.1\r\n") and b"Content-Length" not in heads[1]
    assert b"X-Extra" not in heads[1]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_the_server_closed_while_idle_is_replaced_not_reused(loop: str) -> None:
    """A proxy restarted between two calls: the second goes out on a new connection and is answered."""

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok())
        await writer.drain()  # then the handler returns and the server closes the connection

    async def go() -> tuple[list[int], int]:
        server = Server(answer_once)
        async with server as url:
            client = HttpClient(url)
            first = await client.request("GET", "/a")
            for _ in range(200):  # the FIN crosses loopback at once; bounded in any case
                if client._conn is None or client._conn.closed:
                    break
                await asyncio.sleep(0.005)
            second = await client.request("GET", "/b")
            await client.aclose()
            return [first.status, second.status], server.connections

    assert run(loop, go()) == ([200, 200], 2)


@pytest.mark.parametrize("loop", LOOPS)
def test_connection_close_chunked_bodies_and_an_idle_connection_past_keepalive(loop: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if b" /close " in head:
                writer.write(ok(b"bye", b"Connection: close\r\n"))
                await writer.drain()
                await reader.read()  # wait for the client's close
                return
            writer.write(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            await writer.drain()

    async def go() -> tuple[list[tuple[int, bytes]], int]:
        server = Server(handler)
        async with server as url:
            client = HttpClient(url, keepalive_s=0.05)
            got = []
            for path in ("/chunked", "/close", "/chunked"):  # the server's close: a new connection
                r = await client.request("GET", path)
                got.append((r.status, r.content))
            await asyncio.sleep(0.1)  # past keepalive_s: not reused however open it is
            r = await client.request("GET", "/chunked")
            got.append((r.status, r.content))
            await client.aclose()
            return got, server.connections

    got, served = run(loop, go())
    assert got == [(201, b"abcde"), (200, b"bye"), (201, b"abcde"), (201, b"abcde")]
    assert served == 3


class Held:
    """Answers each request with its path at once, but ``/late``: held until ``release`` is set, then answered
    on its connection (closed by then, if the client did its job)."""

    def __init__(self) -> None:
        self.arrived, self.release, self.sent = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            path = head.split(b" ")[1]
            if path == b"/late":
                self.arrived.set()
                await self.release.wait()
                try:
                    writer.write(ok(path))
                    await writer.drain()
                finally:
                    self.sent.set()
                return
            writer.write(ok(path))
            await writer.drain()


def late_answer_then_two_calls(
    loop: str, cut: Callable[[HttpClient, Held], Awaitable[None]]
) -> tuple[list[bytes], int]:
    """On ``loop``, against a server that holds its answer to ``/late``: ``cut`` ends a call to ``/late``; then
    one call, the late answer released and written, one more call. The two calls' bodies, and how many
    connections the server accepted."""

    async def go() -> tuple[list[bytes], int]:
        held = Held()
        server = Server(held)
        async with server as url:
            client = HttpClient(url)
            await cut(client, held)
            first = await client.request("GET", "/next", timeout_s=2)
            held.release.set()
            await held.sent.wait()
            second = await client.request("GET", "/next", timeout_s=2)
            await client.aclose()
            return [first.content, second.content], server.connections

    return run(loop, go())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_call_past_its_bound_times_out_and_its_late_answer_is_not_read_by_the_next(loop: str) -> None:
    async def cut(client: HttpClient, held: Held) -> None:
        with pytest.raises(Timeout, match=r"within 0\.05 s"):
            await client.request("GET", "/late", timeout_s=0.05)

    assert late_answer_then_two_calls(loop, cut) == ([b"/next", b"/next"], 2)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cancelled_call_closes_its_connection(loop: str) -> None:
    async def cut(client: HttpClient, held: Held) -> None:
        call = asyncio.create_task(client.request("GET", "/late"))
        await held.arrived.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    assert late_answer_then_two_calls(loop, cut) == ([b"/next", b"/next"], 2)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (b"", "closed before the whole answer"),  # accepted, then closed with no answer
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "closed before the whole answer"),  # cut mid-body
        (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP answer"),
    ],
)
def test_broken_answers_are_unreachable(loop: str, reply: bytes, match: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()

    async def go() -> None:
        async with Server(handler) as url:
            client = HttpClient(url)
            with pytest.raises(Unreachable, match=match):
                await client.request("POST", "/x", b"{}", timeout_s=5)
            await client.aclose()

    run(loop, go())


@pytest.mark.parametrize("loop", LOOPS)
def test_nothing_listening_is_unreachable_at_once(loop: str) -> None:
    async def go() -> None:
        client = HttpClient(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(Unreachable, match="ConnectionRefusedError"):
            await client.request("GET", "/x", timeout_s=5)

    run(loop, go())


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http"):
        HttpClient("ftp://h/x")
