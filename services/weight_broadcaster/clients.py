"""HTTP calls to proxies and engines, answered as plain results (never raised into the loop).

Every transport error, non-2xx answer or answer missing a field the broadcaster needs
becomes a result with ``ok=False`` and the reason, so the caller's decision logic sees one
shape (:mod:`decide`). Engines are spoken to in SGLang's native API: ``POST
/update_weights_from_disk`` (answer ``{success, message, num_paused_requests}``) and ``GET
/get_model_info`` (``weight_version``, normalised here where the engine's label enters; rein's
engine adds ``digest``). Extra fields are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from services.weight_broadcaster.decide import PauseAnswer
from shared.versions import real_version


@dataclass(frozen=True)
class EngineAnswer:
    engine: str
    ok: bool
    weight_version: str | None = None
    """The engine's label, normalised (None: it serves no real version)."""
    digest: str | None = None
    error: str = ""
    served: bool = False
    """The answer says what the engine serves (``/get_model_info``, or rein's update answer)."""
    staged: bool = False
    """rein's update answer: the engine swapped in the checkpoint it had staged (read before the pause)."""


def _error(exc: Exception | httpx.Response) -> str:
    if isinstance(exc, httpx.Response):
        return f"HTTP {exc.status_code}: {exc.text[:300]}"
    return f"{type(exc).__name__}: {exc}"


class ControlClient:
    """One httpx client for every control call; admin calls carry the bearer token."""

    def __init__(self, admin_token: str, timeout_s: float) -> None:
        self._auth = {"Authorization": f"Bearer {admin_token}"}
        self._http = httpx.Client(timeout=timeout_s)

    def _post(self, url: str, body: dict[str, Any], timeout_s: float | None, admin: bool) -> dict[str, Any]:
        resp = self._http.post(url, json=body, headers=self._auth if admin else None,
                               timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT)
        if resp.status_code // 100 != 2:
            raise _HTTPError(_error(resp))
        data: Any = resp.json()
        if not isinstance(data, dict):
            raise _HTTPError(f"HTTP {resp.status_code}: a JSON object was expected, got {resp.text[:300]}")
        return data

    def pause(self, proxy: str, reason: str, timeout_s: float, pause_id: str, lease_s: float) -> PauseAnswer:
        body = {"reason": reason, "timeout_s": timeout_s, "pause_id": pause_id, "lease_s": lease_s}
        try:
            data = self._post(f"{proxy}/v1/rollout/pause", body, timeout_s + 10.0, admin=True)
        except (httpx.HTTPError, _HTTPError, ValueError) as exc:
            return PauseAnswer(proxy=proxy, ok=False, quiesced=False, error=str(exc) or type(exc).__name__)
        preempted = data.get("preempted", [])
        return PauseAnswer(proxy=proxy, ok=True, quiesced=bool(data.get("quiesced", False)),
                           preempted=len(preempted) if isinstance(preempted, list) else int(preempted or 0))

    def renew(self, proxy: str, pause_id: str, lease_s: float) -> str:
        """Extend ``pause_id``'s lease on ``proxy``; empty string on success, else the error (409: not its pause)."""
        try:
            self._post(f"{proxy}/v1/rollout/renew", {"pause_id": pause_id, "lease_s": lease_s}, None, admin=True)
        except (httpx.HTTPError, _HTTPError, ValueError) as exc:
            return str(exc) or type(exc).__name__
        return ""

    def resume(self, proxy: str, version: str | None, pause_id: str | None = None) -> str:
        """Empty string on success, else the error. With ``pause_id`` only that pause is ended."""
        body: dict[str, Any] = {"version": version} if version is not None else {}
        if pause_id is not None:
            body["pause_id"] = pause_id
        try:
            self._post(f"{proxy}/v1/rollout/resume", body, None, admin=True)
        except (httpx.HTTPError, _HTTPError, ValueError) as exc:
            return str(exc) or type(exc).__name__
        return ""

    def update(self, engine: str, model_path: str, version: str, timeout_s: float, abort_all: bool) -> EngineAnswer:
        """Load ``model_path`` labelled ``version``; ok means the engine said ``success``. rein's
        engine also says what it serves now (``weight_version``, ``digest``: ``served``); SGLang's
        answer does not, so the caller reads it with :meth:`model_info`."""
        body = {"model_path": model_path, "weight_version": version, "abort_all_requests": abort_all}
        try:
            data = self._post(f"{engine}/update_weights_from_disk", body, timeout_s, admin=False)
        except (httpx.HTTPError, _HTTPError, ValueError) as exc:
            return EngineAnswer(engine=engine, ok=False, error=str(exc) or type(exc).__name__)
        if "success" not in data:
            return EngineAnswer(engine=engine, ok=False,
                                error=f"/update_weights_from_disk answered without success: {str(data)[:300]}")
        if data["success"] is not True:
            return EngineAnswer(engine=engine, ok=False, error=str(data.get("message") or "success=false"))
        if "weight_version" not in data:
            return EngineAnswer(engine=engine, ok=True)
        digest = data.get("digest")
        return EngineAnswer(engine=engine, ok=True, weight_version=real_version(data["weight_version"]),
                            digest=None if digest is None else str(digest), served=True,
                            staged=data.get("staged") is True)

    def stage(self, engine: str, model_path: str, timeout_s: float) -> str | None:
        """Ask ``engine`` to read ``model_path`` ahead of its update (rein's ``/stage_weights``):
        empty string when it did, None when it has no such route (404/405: SGLang), else the error."""
        try:
            resp = self._http.post(f"{engine}/stage_weights", json={"model_path": model_path}, timeout=timeout_s)
        except httpx.HTTPError as exc:
            return str(exc) or type(exc).__name__
        if resp.status_code in (404, 405):
            return None
        return "" if resp.status_code // 100 == 2 else _error(resp)

    def model_info(self, engine: str) -> EngineAnswer:
        """What ``engine`` serves: ``weight_version`` (required) and rein's ``digest`` (None if absent)."""
        try:
            resp = self._http.get(f"{engine}/get_model_info")
            if resp.status_code // 100 != 2:
                raise _HTTPError(_error(resp))
            data = resp.json()
        except (httpx.HTTPError, _HTTPError, ValueError) as exc:
            return EngineAnswer(engine=engine, ok=False, error=str(exc) or type(exc).__name__)
        if not isinstance(data, dict) or "weight_version" not in data:
            return EngineAnswer(engine=engine, ok=False,
                                error=f"/get_model_info answered without weight_version: {str(data)[:300]}")
        version, digest = data["weight_version"], data.get("digest")
        return EngineAnswer(engine=engine, ok=True, weight_version=real_version(version),
                            digest=None if digest is None else str(digest), served=True)

    def close(self) -> None:
        self._http.close()


class _HTTPError(Exception):
    """A non-2xx answer (kept inside this module)."""
