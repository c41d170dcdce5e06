"""The proxy's control plane: pause, renew, resume, and the lease that ends a pause nobody renewed.

A base of :class:`~services.proxy.service.ProxyService` (the same endpoints, no HTTP), apart from the
chat path because it touches only the engines, the pause controller and the metrics, never a session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from services.proxy.engine_client import AbortOutcome
from services.proxy.engine_pool import EnginePool
from services.proxy.generation import ActiveRequest, PauseController, PauseResult
from services.proxy.metrics import ProxyMetrics
from services.proxy.settings import ProxySettings
from shared import log
from shared.errors import EngineError, EngineUnavailable, StalePause
from shared.schemas import new_id
from shared.versions import real_version

_log = log.get(__name__)


class PauseControl:
    """Pause, renew and resume over the attributes :class:`~services.proxy.service.ProxyService` sets."""

    settings: ProxySettings
    engines: EnginePool
    controller: PauseController
    metrics: ProxyMetrics

    async def pause(
        self, reason: str, timeout_s: float | None, pause_id: str | None = None, lease_s: float | None = None
    ) -> dict[str, Any]:
        async def abort(requests: Sequence[ActiveRequest]) -> dict[str, AbortOutcome]:
            engine = self.engines.handle(requests[0].engine)
            return await engine.abort_many([r.rid for r in requests], self.settings.engine_connect_timeout_s)

        result: PauseResult = await self.controller.pause(
            reason, timeout_s or self.settings.pause_timeout_s, abort, self.settings.abort_retry_s,
            pause_id=pause_id or new_id("pause"), lease_s=lease_s or self.settings.pause_lease_s,
        )
        self.metrics.pause_seconds.observe(result.waited_s)
        _log.info("paused", reason=reason, quiesced=result.quiesced, preempted=len(result.preempted),
                  active=result.active, waited_s=round(result.waited_s, 4), pause_id=result.pause_id,
                  lease_s=result.lease_s)
        return {
            "status": result.status, "quiesced": result.quiesced, "preempted": result.preempted,
            "aborts_sent": result.aborts_sent, "active": result.active, "held": self.controller.held,
            "waited_s": result.waited_s, "reason": reason, "pause_id": result.pause_id, "lease_s": result.lease_s,
        }

    def renew(self, pause_id: str, lease_s: float | None) -> dict[str, Any]:
        lease = lease_s or self.settings.pause_lease_s
        if not self.controller.renew(pause_id, lease):
            raise self._stale(pause_id)
        return {"status": "renewed", "pause_id": pause_id, "lease_s": lease}

    async def resume(self, version: str | None, pause_id: str | None = None) -> dict[str, Any]:
        """Release held generations. ``version`` (the label every engine now serves) becomes each
        engine's known version; without it each engine's ``/model_info`` is read (best effort), so
        the span pre-check of the held generations sees the new version before spending compute.
        With ``pause_id``, only that pause is ended (:class:`StalePause` otherwise)."""
        if pause_id is not None and pause_id != self.controller.pause_id:
            raise self._stale(pause_id)
        label = real_version(version)
        if label is not None:
            for engine in self.engines.all():
                engine.observe(label)
        else:
            engines = self.engines.routable()  # one that is down would hold the resume for its connect timeout
            answers = await asyncio.gather(*(e.refresh() for e in engines), return_exceptions=True)
            for engine, answer in zip(engines, answers, strict=True):
                if isinstance(answer, EngineUnavailable | EngineError):
                    _log.warning("engine_info_unavailable_at_resume", engine=engine.url, error=str(answer))
                elif isinstance(answer, BaseException):
                    raise answer
        closed_s = self.controller.closed_s()
        status = self.controller.resume(pause_id)
        if status == "stale":  # another pause began while the engines were read
            raise self._stale(pause_id or "")
        if status == "resumed" and closed_s is not None:
            self.metrics.pause_closed_seconds.observe(closed_s)
        _log.info("resumed", version=label, status=status, held=self.controller.held, pause_id=pause_id,
                  closed_s=None if closed_s is None else round(closed_s, 4))
        return {"status": status, "version": label, "held": self.controller.held}

    def _stale(self, pause_id: str) -> StalePause:
        return StalePause(
            f"pause {pause_id!r} is not this proxy's current pause", pause_id=pause_id,
            current=self.controller.pause_id if self.controller.paused else None,
        )

    async def expire_lease(self) -> bool:
        """End the current pause if its lease ran out: resume on what the engines report. True if it did."""
        if not self.controller.expired():
            return False
        pause_id = self.controller.pause_id
        _log.warning("pause_lease_expired", pause_id=pause_id, reason=self.controller.reason,
                     held=self.controller.held, note="no renew or resume came: resuming on the engines' versions")
        self.metrics.lease_expiries.inc()
        await self.resume(None, pause_id)
        return True
