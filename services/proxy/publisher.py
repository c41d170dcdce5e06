"""Kafka side of the proxy: publish one record and wait for the broker's ack.

kafka-python blocks, so every send runs in a worker thread. The producer is built
lazily (and rebuilt after a failed start), so a proxy started before its broker
serves non-training sessions and answers training calls with 503
``kafka_unavailable`` until the broker is reachable, instead of crashing or
silently dropping records.
"""

from __future__ import annotations

import asyncio

from kafka.errors import KafkaError

from shared import log
from shared.bus import BusUnavailable, Producer
from shared.errors import KafkaUnavailable
from shared.schemas import Record
from shared.settings import KafkaSettings

_log = log.get(__name__)


class Publisher:
    """One idempotent producer (acks=all) shared by every request of the app."""

    def __init__(self, settings: KafkaSettings) -> None:
        self._settings = settings
        self._producer: Producer | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Try to connect now; a failure is logged and retried on the first send."""
        try:
            await self._connected()
        except KafkaUnavailable as exc:
            _log.warning("kafka_unavailable_at_start", error=str(exc))

    async def send(self, topic: str, record: Record) -> None:
        """Write ``record`` (keyed by its ``key()``) and wait for the ack; 503 on any broker failure."""
        producer = await self._connected()
        try:
            await asyncio.to_thread(producer.send, topic, record)
        except (BusUnavailable, KafkaError) as exc:
            raise KafkaUnavailable(
                f"could not write a {record.type} record to Kafka topic {topic!r}: {exc}", topic=topic
            ) from exc

    async def _connected(self) -> Producer:
        async with self._lock:
            if self._producer is None:
                try:
                    self._producer = await asyncio.to_thread(Producer, self._settings, "proxy")
                except (BusUnavailable, KafkaError) as exc:
                    raise KafkaUnavailable(
                        f"no Kafka broker at {self._settings.bootstrap_servers}: {exc}",
                        bootstrap_servers=self._settings.bootstrap_servers,
                    ) from exc
            return self._producer

    async def close(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await asyncio.to_thread(producer.close)
