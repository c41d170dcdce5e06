"""What one proxy app owns while it runs, opened and closed by its lifespan (no module globals).

Opens the engines' HTTP clients, the engine pool (fixed and registered engines, watched for health),
the Kafka publisher, the pause controller and the :class:`ProxyService`, and the background tasks that
expire idle sessions and pause leases; the service and the metrics reach the routes as lifespan state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from services.proxy.engine_client import ENGINE_HEADERS, EngineHandle
from services.proxy.engine_pool import EnginePool
from services.proxy.generation import PauseController
from services.proxy.joining import Joining
from services.proxy.metrics import ProxyMetrics
from services.proxy.publisher import Publisher
from services.proxy.service import ProxyService
from services.proxy.settings import ProxySettings
from shared import log
from shared.errors import EngineError, EngineUnavailable
from shared.http_client import HttpClient
from shared.lender import Lender
from shared.membership import Members
from shared.model import ChatTokenizer
from shared.names import RedisKeys
from shared.state import connect

_log = log.get(__name__)


def lifespan(settings: ProxySettings, tokenizer: ChatTokenizer,
             ) -> Callable[[FastAPI], AbstractAsyncContextManager[dict[str, Any]]]:
    """The lifespan of an app: yields ``{"service", "metrics"}``, closes everything it opened."""

    @asynccontextmanager
    async def run(_: FastAPI) -> AsyncIterator[dict[str, Any]]:
        registry = CollectorRegistry(auto_describe=True)
        proxy_metrics = ProxyMetrics(registry)
        tls = httpx.create_ssl_context()  # one for every client: each would load the CA bundle (~50 ms)
        lenders: list[Lender[HttpClient]] = []

        def handle(url: str) -> EngineHandle:
            clients = Lender(lambda: HttpClient(url, ENGINE_HEADERS, ssl_context=tls,
                                                connect_timeout_s=settings.engine_connect_timeout_s))
            lenders.append(clients)
            return EngineHandle(url, clients, settings.context_window, settings.engine_connect_timeout_s,
                                settings.engine_timeout_s)

        redis_client = None
        try:
            members = None
            # One Redis client for the registered engines and this proxy's own registration. Unreachable: the
            # proxy does not start (StateUnavailable says why): it could route nowhere, or not be found to pause.
            if settings.discover_engines or settings.advertise_url:
                redis_client = await asyncio.to_thread(connect, settings.redis)
            if settings.discover_engines and redis_client is not None:
                members = Members(redis_client, RedisKeys(settings.redis.key_prefix), "engine")
            engines = EnginePool([handle(url) for url in settings.engine_urls], handle, members,
                                 settings.engine_unhealthy_after)
            for engine in engines.all():
                try:
                    await engine.refresh()
                except (EngineUnavailable, EngineError) as exc:
                    _log.warning("engine_info_unavailable_at_start", engine=engine.url, error=str(exc))
            if members is not None:
                await engines.check()  # the registered engines take sessions from the first call on
            publisher = Publisher(settings.kafka, settings.publish_max_inflight_bytes, proxy_metrics)
            await publisher.start()
            service = ProxyService(settings, engines, publisher, PauseController(), proxy_metrics, tokenizer,
                                   state=redis_client)
            _log.info("proxy ready", engines=[(e.url, e.version) for e in engines.all()],
                      discover_engines=settings.discover_engines,
                      partial_rollout=settings.partial_rollout, max_preempts=settings.max_preempts)
            tasks = [asyncio.create_task(_expire_idle_sessions(service)),
                     asyncio.create_task(_expire_pause_leases(service)),
                     asyncio.create_task(engines.watch(settings.engine_health_interval_s))]
            joined = None
            try:
                if settings.advertise_url and redis_client is not None:
                    joined = await Joining.start(settings, service, redis_client)
                yield {"service": service, "metrics": proxy_metrics}
            finally:
                if joined is not None:
                    await joined.stop()
                for task in tasks:
                    task.cancel()
                service.controller.resume()  # release held calls so shutdown does not hang on them
                await publisher.close()
                if service.handoff is not None:  # the last snapshots, now that their chunks are answered
                    await service.handoff.close(timeout_s=1.0)
        finally:
            if redis_client is not None:
                redis_client.close()
            for clients in lenders:
                for client in clients.items:
                    await client.aclose()

    return run


async def _expire_pause_leases(service: ProxyService) -> None:
    """End a pause whose lease ran out (checked every 0.1 s while paused, every 0.5 s otherwise)."""
    while True:
        left = service.controller.lease_left_s()
        await asyncio.sleep(0.5 if left is None else min(max(left, 0.0) + 0.01, 0.1))
        try:
            await service.expire_lease()
        except Exception:  # a bug here must not end the watch, nor the proxy
            _log.exception("lease_watch_failed")


async def _expire_idle_sessions(service: ProxyService) -> None:
    """Sweep for idle sessions a few times per idle timeout (at least every 30 s) until cancelled."""
    timeout = service.settings.session_idle_timeout_s
    if not timeout:
        return
    interval = min(timeout / 4, 30.0)
    while True:
        await asyncio.sleep(interval)
        try:
            await service.expire_idle()
        except Exception:  # a bug here must not end the sweeps, nor the proxy
            _log.exception("idle_sweep_failed")
