"""The runner's HTTP client of the proxy: JSON calls over one httpcore connection per episode in flight.

rein's own agent loop calls one route with small JSON bodies many times a second, on the machine that
also generates and trains: the official ``openai`` client spent about four times the CPU of this
client per chat call there (request-parameter transforms over the whole conversation, response
models, httpx's layers; docs/benchmarks.md), the largest share of the pipeline's CPU. The proxy speaks
OpenAI's wire either way, and the official clients are exercised unchanged against it by the agent
tests (``tests/integration/agents``). One client per episode in flight (:class:`~shared.lender.Lender`),
each with one pooled connection, for the reason the lender gives.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from dataclasses import dataclass
from typing import Any

import httpcore

_TRANSPORT_ERRORS = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
                     httpcore.ProxyError, httpcore.ConnectionNotAvailable)


class Unreachable(Exception):
    """The proxy could not be reached (refused, reset, not HTTP)."""


class Timeout(Exception):
    """The proxy did not answer within the client's bound."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any
    """The decoded JSON body; None when it was not JSON."""


class ProxyHttp:
    """Calls of one episode to the proxy at ``base_url``; ``headers`` go on every call (the runner's credential)."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self._timeouts = {"connect": min(5.0, timeout_s), "read": timeout_s, "write": timeout_s, "pool": timeout_s}
        self._ssl = ssl_context
        self._pool = self._new_pool()

    def _new_pool(self) -> httpcore.AsyncConnectionPool:
        return httpcore.AsyncConnectionPool(ssl_context=self._ssl, max_connections=1, max_keepalive_connections=1,
                                            keepalive_expiry=5.0)

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Answer:
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        return await self._call(b"POST", path, [*self._headers, *extra, (b"Content-Type", b"application/json"),
                                                (b"Content-Length", str(len(raw)).encode())], raw)

    async def get(self, path: str) -> Answer:
        return await self._call(b"GET", path, self._headers, b"")

    async def _call(self, method: bytes, path: str, headers: list[tuple[bytes, bytes]], content: bytes) -> Answer:
        url = f"{self.base_url}{path}".encode()
        try:
            try:
                response = await self._pool.request(method, url, headers=headers, content=content,
                                                    extensions={"timeout": self._timeouts})
            except AttributeError:
                # uvloop forgets a connection's socket once the peer closed it (a proxy restarted), and anyio's
                # stream then fails with AttributeError when httpcore checks the pooled connection, before the
                # request is sent: drop the pool and send once more on a new connection.
                with contextlib.suppress(AttributeError, OSError, *_TRANSPORT_ERRORS):
                    await self._pool.aclose()
                self._pool = self._new_pool()
                response = await self._pool.request(method, url, headers=headers, content=content,
                                                    extensions={"timeout": self._timeouts})
        except httpcore.TimeoutException as exc:
            raise Timeout(str(exc) or type(exc).__name__) from None
        except (*_TRANSPORT_ERRORS, AttributeError) as exc:
            raise Unreachable(str(exc) or type(exc).__name__) from None
        try:
            decoded = json.loads(response.content) if response.content else None
        except ValueError:
            decoded = None
        return Answer(response.status, decoded)

    async def aclose(self) -> None:
        await self._pool.aclose()
