"""A lean HTTP/1.1 client for rein's hot JSON calls: one kept-alive connection, asyncio transports, llhttp.

The rollout runner calls the proxy, and the proxy its engine, once per chat call each. Through
httpcore (h11's parser and anyio's streams, in Python) that exchange was two thirds of the runner's
CPU and a third of the proxy's (py-spy, docs/benchmarks.md "Where the CPU of a chat call goes"). Here
a request is one ``transport.write`` of bytes joined once, and its answer is parsed by ``httptools``
(llhttp, in C; uvicorn's parser on the servers' side).

Scope, what those calls need: one request at a time on one connection (callers lend a client to each
call in flight, :mod:`shared.lender`), kept alive while the server keeps it and reused only within
``keepalive_s`` of its last answer (rein's servers keep idle connections longer,
:data:`shared.http_server.KEEP_ALIVE_S`, so the client closes first); http and https; answers framed
by Content-Length or chunked. Not: redirects, proxies, HTTP/2, streamed bodies, or an answer that ends
with the connection (uvicorn, rein's servers' and SGLang's, never sends one). Failures are two
exceptions, :class:`Unreachable` and :class:`Timeout`. A call cut short (its bound, a cancellation)
closes its connection: a late answer on it would otherwise be read as the next call's.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools


class Unreachable(Exception):
    """No answer from the server: refused, reset, closed before the whole answer, or not HTTP."""


class Timeout(Exception):
    """The server did not answer within the call's bound (or did not accept the connection within its own)."""


@dataclass(frozen=True)
class Response:
    status: int
    content: bytes


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: writes a request, parses its answer, notices the server's close."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[Response] | None = None
        self._body: list[bytes] = []
        self._keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP transport (uvloop's is no asyncio subclass)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Unreachable(f"connection closed before the whole answer{f': {exc}' if exc else ''}"))

    def data_received(self, data: bytes) -> None:
        if self._answer is None or self._answer.done():
            self.close()  # bytes nobody asked for: this connection's framing can no longer be trusted
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Unreachable(f"not an HTTP answer: {exc}"))
            self.close()

    # httptools' callbacks
    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        answer, body = self._answer, b"".join(self._body)
        self._body = []
        if answer is not None and not answer.done():
            answer.set_result(Response(self._parser.get_status_code(), body))
        if not self._keep_alive:
            self.close()

    def send(self, data: bytes) -> asyncio.Future[Response]:
        """Write one request; the future is its answer."""
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self._body = []
        self.transport.write(data)
        return self._answer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)


class HttpClient:
    """Calls to one server at ``base_url``; ``headers`` go on every request (a credential, Accept)."""

    def __init__(self, base_url: str, headers: Mapping[str, str] | None = None, *,
                 ssl_context: ssl.SSLContext | None = None, connect_timeout_s: float = 5.0,
                 keepalive_s: float = 5.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        netloc = parts.netloc.rpartition("@")[2]
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in {"Host": netloc, **(headers or {})}.items())
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._conn: _Connection | None = None
        self.connections = 0
        """Connections opened so far (for tests and diagnostics)."""

    async def request(self, method: str, path: str, body: bytes | None = None, *, timeout_s: float | None = None,
                      headers: Mapping[str, str] | None = None) -> Response:
        """Send one request and return its answer, or raise :class:`Unreachable` / :class:`Timeout`.
        ``timeout_s`` bounds the whole call (None: unbounded but for the connect bound)."""
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._fixed}"
        if headers:
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if body is not None:
            head += f"Content-Length: {len(body)}\r\n"
        data = (head + "\r\n").encode("latin-1") + (body or b"")
        answered = False
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self._connection()
                response = await conn.send(data)
            answered = True
            conn.idle_since = asyncio.get_running_loop().time()
            return response
        except TimeoutError:  # before OSError: TimeoutError is one
            raise Timeout(f"no answer from {self.base_url}{path} within {timeout_s} s") from None
        except OSError as exc:
            raise Unreachable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from None
        finally:
            if not answered and self._conn is not None:
                self._conn.close()
                self._conn = None

    async def _connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None and (conn.closed or loop.time() - conn.idle_since > self._keepalive_s):
            conn.close()
            conn = self._conn = None
        if conn is None:
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    _, conn = await loop.create_connection(_Connection, self._host, self._port, ssl=self._ssl)
            except TimeoutError:
                raise Timeout(f"{self.base_url} did not accept a connection within {self._connect_timeout_s} s"
                              ) from None
            self.connections += 1
            conn.idle_since = loop.time()
            self._conn = conn
        return conn

    async def aclose(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
