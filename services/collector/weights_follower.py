"""The weights follower: every collector replica reads ``weights`` into the Redis version registry.

It reads the topic from the beginning without a consumer group, so each replica rebuilds
the registry by itself (publishing a label with its sequence is idempotent). The registry
therefore has several writers, the broadcaster and every replica, all writing the same
``(label, seq)`` pairs from the one topic; the trainer's sequence numbers are the order.
"""

from __future__ import annotations

import time

from kafka import TopicPartition

from services.collector.metrics import CollectorMetrics
from services.collector.settings import CollectorSettings
from shared import log
from shared.bus import Consumer
from shared.codec import DecodeError
from shared.schemas import WeightApplied, WeightPublished
from shared.state import RedisRegistry

_log = log.get(__name__)


class WeightsFollower:
    """Reads ``weights`` from the beginning (no consumer group) into the Redis registry."""

    def __init__(self, settings: CollectorSettings, registry: RedisRegistry, metrics: CollectorMetrics) -> None:
        self.topic = settings.topics.weights
        self.registry = registry
        self.metrics = metrics
        self.consumer = Consumer(settings.kafka, (), None, on_decode_error=self._bad, client_suffix="collector-weights")
        self.known: dict[str, int] = {}
        """label -> sequence of every weight record read (the first one of a label wins, as in Redis)."""
        self._unpublished: dict[str, int] = {}
        self._refused: set[str] = set()
        self.timeout_s = settings.kafka.request_timeout_ms / 1000
        raw = self.consumer.raw
        self.tps = [TopicPartition(self.topic, p) for p in self.partitions(self.topic)]
        raw.assign(self.tps)
        raw.seek_to_beginning(*self.tps)

    def partitions(self, topic: str) -> list[int]:
        """Partition ids of ``topic`` once the broker's metadata lists them (bounded wait)."""
        raw = self.consumer.raw
        deadline = time.monotonic() + self.timeout_s
        parts = raw.partitions_for_topic(topic)
        while not parts:
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic!r} has no partitions (metadata did not arrive)")
            raw.cluster.request_update()
            raw.poll(timeout_ms=100)  # drives the metadata request
            parts = raw.partitions_for_topic(topic)
        return sorted(parts)

    def _bad(self, topic: str, partition: int, offset: int, exc: DecodeError) -> None:
        self.metrics.decode_errors.inc(topic, exc.reason)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Fold new weight records into Redis. Each is remembered first, so a Redis error here loses
        nothing: the unpublished ones are published on the next call, and :meth:`repair` restores
        whatever Redis lost."""
        n = 0
        for polled in self.consumer.poll(timeout_s):
            record = polled.record
            if isinstance(record, WeightPublished | WeightApplied) and record.version not in self.known:
                self.known[record.version] = record.seq
                self._unpublished[record.version] = record.seq
                n += 1
        self._publish_unpublished()
        return n

    def repair(self) -> None:
        """Rebuild the registry from the records read so far when Redis holds fewer than were read
        (Redis restarted empty, or its keys were deleted): one ZCARD when nothing is missing."""
        in_redis = self.registry.count()
        if in_redis < len(self.known) - len(self._refused):
            _log.warning("registry_rebuilt", known=len(self.known), in_redis=in_redis)
            self.metrics.registry_rebuilds.inc()
            self._unpublished = {k: v for k, v in self.known.items() if k not in self._refused}
            self._publish_unpublished()

    def _publish_unpublished(self) -> None:
        for label, seq in sorted(self._unpublished.items(), key=lambda kv: kv[1]):
            try:
                self.registry.publish(label, seq)
            except ValueError as exc:
                self._refused.add(label)
                self.metrics.weight_errors.inc()
                _log.error("weight_refused", version=label, seq=seq, error=str(exc))
            del self._unpublished[label]

    def catch_up(self, timeout_s: float) -> None:
        """Read until every partition's position reaches the end offset seen now (bounded)."""
        raw = self.consumer.raw
        end = raw.end_offsets(self.tps)
        deadline = time.monotonic() + timeout_s
        while any(raw.position(tp) < end[tp] for tp in self.tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.topic!r} to its end within {timeout_s}s")
            self.poll(0.1)

    def close(self) -> None:
        self.consumer.close()
