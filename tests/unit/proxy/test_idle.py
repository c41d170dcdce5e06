"""Idle-session expiry: the rejection is on record before the session is dropped."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry

from services.proxy.engine_pool import EnginePool
from services.proxy.generation import PauseController
from services.proxy.metrics import ProxyMetrics
from services.proxy.service import ProxyService
from services.proxy.settings import ProxySettings
from shared.errors import KafkaUnavailable
from shared.model.tiny_chat import TinyChatTokenizer
from shared.schemas import SessionRejected


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class FlakyPublisher:
    """Refuses the first ``failures`` sends like a broker that is down, then records them."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[Any] = []

    async def send(self, topic: str, record: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise KafkaUnavailable("broker down")
        self.sent.append(record)


def service(publisher: FlakyPublisher, clock: Clock, timeout_s: float = 10.0) -> ProxyService:
    settings = ProxySettings(admin_token="x" * 16, open_sessions=True, session_key_secret="k" * 16, run_id="r",
                             session_idle_timeout_s=timeout_s)
    return ProxyService(
        settings, EnginePool([]), publisher, PauseController(), ProxyMetrics(CollectorRegistry()), TinyChatTokenizer(),  # type: ignore[arg-type]
        clock=clock,
    )


def test_a_rejection_kafka_refused_is_tried_again_and_the_sessions_stay_live_meanwhile() -> None:
    clock, publisher = Clock(), FlakyPublisher(failures=1)
    svc = service(publisher, clock)
    svc.sessions.release(svc.sessions.acquire("s", "g"))
    clock.now = 1.0
    svc.sessions.release(svc.sessions.acquire("t", "g"))
    clock.now = 11.0
    assert asyncio.run(svc.expire_idle()) == 0  # the first send failed: the sweep stops there
    assert publisher.sent == [] and len(svc.sessions) == 2
    assert not svc.sessions.get("s").busy  # a late finish can still be taken
    assert asyncio.run(svc.expire_idle()) == 2
    rejected = [(r.session_id, r.error) for r in publisher.sent if isinstance(r, SessionRejected)]
    assert rejected == [("s", "session_idle"), ("t", "session_idle")]
    assert len(svc.sessions) == 0 and svc.sessions.outcome("s") == "rejected (session_idle)"


def test_untracked_sessions_expire_without_a_record_and_zero_means_never() -> None:
    clock, publisher = Clock(), FlakyPublisher(failures=0)
    svc = service(publisher, clock)
    svc.sessions.release(svc.sessions.acquire("s", ""))
    clock.now = 10.0
    assert asyncio.run(svc.expire_idle()) == 1
    assert publisher.sent == []
    never = service(publisher, clock, timeout_s=0)
    never.sessions.release(never.sessions.acquire("t", "g"))
    clock.now = 1e9
    assert asyncio.run(never.expire_idle()) == 0 and len(never.sessions) == 1
