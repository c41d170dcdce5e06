"""The broadcaster's process: its clients, its ``/metrics`` and ``/health``, and the poll loop around
:class:`services.weight_broadcaster.loop.Broadcaster`.

Reads ``weights`` in its consumer group; each poll's ``WeightPublished`` records are handled, then
their offsets committed, so a crash replays them and the replay is idempotent. A Redis or Kafka outage
is waited out: the poll's records are handled again once the dependency is back. Every
``reconcile_interval_s`` the engines' versions are checked as well.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry

from services.weight_broadcaster.clients import ControlClient
from services.weight_broadcaster.loop import Broadcaster
from services.weight_broadcaster.metrics import BroadcasterMetrics
from services.weight_broadcaster.settings import BroadcasterSettings
from shared import log
from shared.bus import Consumer, Polled, Producer, read_topic
from shared.codec import DecodeError
from shared.membership import Members
from shared.names import RedisKeys
from shared.outage import DEPENDENCY_ERRORS, Outage
from shared.pause_record import PauseRecord
from shared.schemas import WeightPublished
from shared.state import RedisRegistry, Replication, connect
from shared.status_server import StatusServer

_log = log.get(__name__)


def run(settings: BroadcasterSettings, stop: threading.Event | None = None) -> None:
    """Consume ``weights`` until ``stop`` is set."""
    stop = stop or threading.Event()
    bmetrics = BroadcasterMetrics(CollectorRegistry(auto_describe=True))
    last_poll = [time.monotonic()]

    def health() -> tuple[bool, dict[str, object]]:
        stalled = time.monotonic() - last_poll[0] > max(120.0, settings.pause_timeout_s * 2 + 60.0)
        return not stalled, {"status": "stalled" if stalled else "ok"}

    redis_client = connect(settings.redis)
    registry = RedisRegistry(redis_client, RedisKeys(settings.redis.key_prefix), Replication.of(settings.redis))
    client = ControlClient(settings.admin_token, settings.http_timeout_s)
    producer = Producer(settings.kafka, client_suffix="broadcaster")
    consumer = Consumer(
        settings.kafka, [settings.topics.weights], settings.consumer_group, client_suffix="broadcaster",
        on_decode_error=lambda topic, _p, _o, exc: bmetrics.decode_errors.inc(
            topic, exc.reason if isinstance(exc, DecodeError) else "unknown"),
    )
    server = StatusServer(settings.metrics_host, settings.metrics_port, bmetrics.registry, health).start()
    keys = registry.keys
    broadcaster = Broadcaster(settings, client, registry, producer, bmetrics, stop,
                              Members(redis_client, keys, "proxy"), PauseRecord(redis_client, keys),
                              Members(redis_client, keys, "engine"))
    _log.info("broadcaster_ready", proxies=settings.proxy_urls, registered=broadcaster.proxies(),
              engines=broadcaster.engines(), port=server.port)
    try:
        timeout_s = settings.kafka.request_timeout_ms / 1000
        broadcaster.recover(read_topic(settings.kafka, settings.topics.weights, timeout_s))
        polled: list[Polled] = []
        outage: Outage | None = None
        next_reconcile = time.monotonic() + settings.reconcile_interval_s
        while not stop.is_set():
            last_poll[0] = now = time.monotonic()
            # Records whose handling failed on Redis or Kafka are handled again (handling is idempotent:
            # the registry publish is, and an applied version is only announced again), then committed.
            try:
                if not polled:
                    polled = consumer.poll(settings.poll_timeout_s)
                events = [p.record for p in polled if isinstance(p.record, WeightPublished)]
                if events:
                    broadcaster.handle(events)
                for p in polled:
                    consumer.done(p.topic, p.partition, p.offset)
                if not stop.is_set():
                    consumer.commit()
                polled = []
                if now >= next_reconcile:
                    next_reconcile = now + settings.reconcile_interval_s
                    broadcaster.reconcile()
            except DEPENDENCY_ERRORS as exc:
                outage = outage or Outage(_log, bmetrics.dependency_errors)
                stop.wait(outage.failed(exc))
                continue
            if outage is not None:
                outage.recovered()
                outage = None
    finally:
        broadcaster.close()
        server.stop()
        consumer.close()
        producer.close()
        client.close()
        redis_client.close()
