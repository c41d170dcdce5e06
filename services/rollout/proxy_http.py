"""The runner's HTTP client of the proxy: JSON calls over one kept-alive connection per episode in flight.

rein's own agent loop calls one route with small JSON bodies many times a second, on the machine that
also generates and trains: the official ``openai`` client spent about four times the CPU of a plain
JSON client per chat call there (request-parameter transforms over the whole conversation, response
models, httpx's layers; docs/benchmarks.md), the largest share of the pipeline's CPU, and httpcore's
exchange most of what was left (:mod:`shared.http_client` says why). The proxy speaks OpenAI's wire
either way, and the official clients are exercised unchanged against it by the agent tests
(``tests/integration/agents``). One client per episode in flight (:class:`~shared.lender.Lender`),
each with one connection, for the reason the lender gives.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

from shared.http_client import HttpClient, Response, Timeout, Unreachable

__all__ = ["Answer", "ProxyHttp", "Timeout", "Unreachable"]

_JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any
    """The decoded JSON body; None when it was not JSON."""


class ProxyHttp:
    """Calls of one episode to the proxy at ``base_url``; ``headers`` go on every call (the runner's credential).
    Each call is bounded by ``timeout_s``; a failure raises :class:`Unreachable` or :class:`Timeout`."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._http = HttpClient(base_url, headers, ssl_context=ssl_context, connect_timeout_s=min(5.0, timeout_s))

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Answer:
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        return self._answer(await self._http.request("POST", path, raw, timeout_s=self._timeout_s,
                                                     headers=_JSON | headers if headers else _JSON))

    async def get(self, path: str) -> Answer:
        return self._answer(await self._http.request("GET", path, timeout_s=self._timeout_s))

    @staticmethod
    def _answer(response: Response) -> Answer:
        try:
            decoded = json.loads(response.content) if response.content else None
        except ValueError:
            decoded = None
        return Answer(response.status, decoded)

    async def aclose(self) -> None:
        await self._http.aclose()
