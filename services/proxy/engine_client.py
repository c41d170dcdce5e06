"""HTTP client of the engines (the subset of SGLang's native HTTP API that docs/architecture.md lists).

One :class:`EngineHandle` per engine URL, with a :class:`~shared.lender.Lender` of
:class:`~shared.http_client.HttpClient`s, one lent to each call in flight, each holding one kept-alive
connection (the lender says why; the client says why not httpx or httpcore). A
handle remembers *its* engine's last known weight version (from ``GET /get_model_info``,
every ``/generate`` answer, ``resume {version}``, and ``/get_model_info`` again on a
resume without a version) — the candidate of the span
pre-check for sessions on that engine only, never a proxy-wide cache fed by other
sessions, whose engine may lag or lead this one. The context window comes from the settings or, once,
from ``GET /get_server_info`` (:func:`context_window_of`), where SGLang keeps it.
Network failures become 503 ``engine_unavailable``; a non-2xx answer or a malformed
body becomes 502 ``engine_error``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from shared.errors import EngineError, EngineUnavailable
from shared.http_client import HttpClient, Timeout, Unreachable
from shared.lender import Lender
from shared.schemas import SamplingParams
from shared.versions import real_version

FinishReason = Literal["stop", "length", "abort"]
ENGINE_HEADERS = {"Accept": "*/*", "Content-Type": "application/json"}
"""The headers of every call to an engine (its clients are made with them)."""

AbortOutcome = Literal["aborted", "finished", "accepted", "unknown"]
"""What an ``/abort_request`` answer says: ``aborted`` the engine ended the request now (its output is
fixed); ``finished`` it had already ended there; ``accepted`` the abort was taken but the end is not
confirmed (SGLang); ``unknown`` the engine did not know the rid (its ``/generate`` may not have arrived)."""
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "aborted": "abort",
    "preempt": "abort",
    "preempted": "abort",
    "cancel": "abort",
    "cancelled": "abort",
    "canceled": "abort",
}


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    """The request's stop strings (sent as SGLang's ``stop``; the engine keeps the one it matched in the output)."""

    def params(self) -> SamplingParams:
        """What the chunk records: the parameters that shape the sampling distribution."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclass(frozen=True)
class EngineOutput:
    """One ``/generate`` answer, normalised."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    version: str | None
    """Normalised ``meta_info.weight_version`` (None when not real)."""
    token_versions: list[str | None]
    """Per-token versions when the engine reports them (rein's engine does; SGLang does not)."""
    finish_reason: FinishReason


class EngineHandle:
    """One engine: its URL, last known version and context window."""

    def __init__(
        self,
        url: str,
        clients: Lender[HttpClient],
        context_window: int | None = None,
        info_timeout_s: float = 5.0,
        timeout_s: float | None = None,
    ) -> None:
        self.url = url
        self._info_timeout_s = info_timeout_s
        self._clients = clients
        """Clients of this engine's ``url``."""
        self._timeout_s = timeout_s
        """The bound of every call without its own (None: unbounded)."""
        self.version: str | None = None
        self.context_window: int | None = context_window
        """Tokens of prompt + output a generation may reach: the settings', else the engine's."""
        self.requests = 0
        """Generate calls sent (for state and tests)."""
        self.bulk_abort: bool | None = None
        """The engine takes rein's ``/abort_requests`` (None: not tried yet; False: it has no such route)."""
        self._calls: set[asyncio.Timeout] = set()
        """The generate calls in flight, each cut short by :meth:`cut`."""

    def observe(self, label: object) -> None:
        """Remember a real version this engine reported (unreal labels change nothing)."""
        version = real_version(label)
        if version is not None:
            self.version = version

    async def refresh(self) -> None:
        """Read ``/get_model_info`` (the version), and ``/get_server_info`` while the window is unknown."""
        info = await self._call("GET", "/get_model_info", None, timeout=self._info_timeout_s)
        if not isinstance(info, dict) or "weight_version" not in info:
            raise EngineError(
                f"engine {self.url} answered /get_model_info without weight_version: {str(info)[:300]}",
                engine=self.url,
            )
        self.observe(info["weight_version"])
        if self.context_window is None:
            server = await self._call("GET", "/get_server_info", None, timeout=self._info_timeout_s)
            self.context_window = context_window_of(server, self.url)

    async def check(self) -> None:
        """``GET /health``: returns when the engine is up, raises what :meth:`_call` raises when it is not
        (unreachable, no answer in time, 5xx: rein's engine answers 503 once its decode loop failed). A
        4xx is an answer from a server without the route: up."""
        try:
            await self._call("GET", "/health", None, timeout=self._info_timeout_s)
        except EngineError as exc:
            status = exc.fields.get("engine_status")
            if not (isinstance(status, int) and 400 <= status < 500):
                raise

    def cut(self) -> None:
        """End every generate call in flight now (the engine failed its health checks): each raises
        ``engine_unavailable`` instead of waiting for an answer that may never come."""
        now = asyncio.get_running_loop().time()
        for call in self._calls:
            call.reschedule(now)

    async def window(self) -> int:
        """The context window, read from the engine the first time it is needed."""
        if self.context_window is None:
            await self.refresh()
        assert self.context_window is not None
        return self.context_window

    async def generate(
        self, rid: str, input_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids: Sequence[int]
    ) -> EngineOutput:
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "stop_token_ids": list(stop_ids),
                "ignore_eos": sampling.ignore_eos,
                **({"stop": list(sampling.stop)} if sampling.stop else {}),
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
            "return_logprob": True,
            "rid": rid,
        }
        self.requests += 1
        try:
            async with asyncio.timeout(None) as call:
                self._calls.add(call)
                try:
                    data = await self._call("POST", "/generate", body, timeout=None)
                finally:
                    self._calls.discard(call)
        except TimeoutError:
            if not call.expired():
                raise
            raise EngineUnavailable(f"engine {self.url} failed its health checks during /generate",
                                    engine=self.url) from None
        out = parse_generate(rid, data, self.url)
        self.observe(out.version)
        return out

    async def abort(self, rid: str, timeout_s: float) -> AbortOutcome:
        """Ask the engine to abort ``rid``; what the answer says about the request (:data:`AbortOutcome`)."""
        data = await self._call("POST", "/abort_request", {"rid": rid, "abort_all": False}, timeout=timeout_s)
        if not isinstance(data, dict):  # SGLang answers 200 with no body: accepted, its end not confirmed
            return "accepted"
        # rein's engine lists the rids it finished now (``aborted``) or that had already finished (``finished``)
        if rid in (data.get("aborted") or ()):
            return "aborted"
        if rid in (data.get("finished") or ()):
            return "finished"
        return "accepted" if data.get("success", True) else "unknown"

    async def abort_many(self, rids: Sequence[str], timeout_s: float) -> dict[str, AbortOutcome]:
        """Abort every rid of ``rids``; what the engine says of each (:data:`AbortOutcome`).

        rein's engine takes them in one ``/abort_requests`` call. An engine without that route
        (SGLang: 404) is remembered as such and gets one ``/abort_request`` per rid, concurrently;
        a rid whose call failed counts as ``unknown`` (sent again by the caller)."""
        if self.bulk_abort is not False:
            try:
                data = await self._call("POST", "/abort_requests", {"rids": list(rids)}, timeout=timeout_s)
            except EngineError as exc:
                if exc.fields.get("engine_status") not in (404, 405):
                    raise
                self.bulk_abort = False
            else:
                self.bulk_abort = True
                aborted = set(data.get("aborted") or ()) if isinstance(data, dict) else set()
                finished = set(data.get("finished") or ()) if isinstance(data, dict) else set()
                return {rid: "aborted" if rid in aborted else "finished" if rid in finished else "unknown"
                        for rid in rids}
        answers = await asyncio.gather(*(self.abort(rid, timeout_s) for rid in rids), return_exceptions=True)
        return {rid: a if isinstance(a, str) else "unknown" for rid, a in zip(rids, answers, strict=True)}

    async def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float | None) -> Any:
        content = None if body is None else json.dumps(  # as httpx encodes ``json=``
            body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        try:
            with self._clients.use() as client:
                resp = await client.request(method, path, content,
                                            timeout_s=self._timeout_s if timeout is None else timeout)
        except (Unreachable, Timeout) as exc:
            raise EngineUnavailable(
                f"engine {self.url} unreachable on {path}: {type(exc).__name__}: {exc}", engine=self.url
            ) from exc
        if resp.status >= 400:
            text = resp.content.decode("utf-8", "replace")
            raise EngineError(
                f"engine {self.url} answered {resp.status} on {path}: {text[:500]}",
                engine=self.url, engine_status=resp.status,
            )
        if not resp.content:
            return {}
        try:
            return json.loads(resp.content)
        except ValueError as exc:
            raise EngineError(f"engine {self.url} sent a non-JSON body on {path}", engine=self.url) from exc


def parse_generate(rid: str, data: Any, engine: str) -> EngineOutput:
    """Normalise a ``/generate`` body (SGLang's shape) or raise 502 ``engine_error``."""
    try:
        meta = cast(dict[str, Any], data["meta_info"])
        finish = meta.get("finish_reason") or {}
        kind = str(finish.get("type") if isinstance(finish, dict) else finish).strip().lower()
        entries = meta.get("output_token_logprobs") or []
        output_ids = data.get("output_ids")
        if output_ids is None:
            output_ids = [int(entry[1]) for entry in entries]
        output_ids = [int(t) for t in output_ids]
        logprobs = [float(entry[0]) for entry in entries]
        label = meta.get("weight_version", meta.get("version"))
        raw_token_versions = meta.get("output_token_weight_versions") or []
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"engine {engine} sent a malformed /generate body: {exc!r}", engine=engine) from exc
    if kind not in _FINISH:
        raise EngineError(f"engine {engine} sent unknown finish reason {kind!r}", engine=engine)
    if len(logprobs) != len(output_ids):
        raise EngineError(
            f"engine {engine} sent {len(logprobs)} logprobs for {len(output_ids)} tokens", engine=engine
        )
    token_versions = [real_version(v) for v in raw_token_versions]
    if len(token_versions) != len(output_ids):
        token_versions = [real_version(label)] * len(output_ids)
    return EngineOutput(
        rid=rid,
        output_ids=output_ids,
        logprobs=logprobs,
        version=real_version(label),
        token_versions=token_versions,
        finish_reason=_FINISH[kind],
    )


def context_window_of(server_info: Any, engine: str) -> int:
    """Prompt + output tokens an engine accepts, from its ``/get_server_info``, or 502.

    SGLang reports ``context_length`` only when it was launched with ``--context-length``
    (else null) and always ``max_req_input_len``: the longest prompt its scheduler admits,
    a few tokens under the model's context (and under the KV pool). A generation that
    keeps prompt + output within the smaller of the two is admitted whole and never
    reaches the model's context, so that is the window."""
    info = server_info if isinstance(server_info, dict) else {}
    limits = [info.get("context_length"), info.get("max_req_input_len")]
    usable = [n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n >= 2]
    if not usable:
        raise EngineError(
            f"engine {engine} reports no usable context window in /get_server_info "
            f"(context_length={limits[0]!r}, max_req_input_len={limits[1]!r}); set REIN_CONTEXT_WINDOW",
            engine=engine,
        )
    return min(usable)
