"""Whole records written to and read from a topic with plain kafka-python clients, for tests that play a
service's neighbour: one encoded record to a chosen partition, and every record now on a topic.

The services' own ``shared.bus`` clients add what a test must not depend on (a consumer group, decode-error
counting, retries); these talk to the broker directly and fail the test when they cannot.
"""

from __future__ import annotations

import time
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from shared.codec import decode, encode
from shared.schemas import Record


def produce(bootstrap: str, topic: str, record: Record, partition: int | None = None, *,
            keyed: bool = True) -> tuple[int, int]:
    """Publish one record (acks=all; to ``partition``, else by its key); its (partition, offset).
    ``keyed=False`` sends it without a key (to ``partition``)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        key = record.key().encode() if keyed else None
        meta = producer.send(topic, key=key, value=encode(record), partition=partition).get(30)
    finally:
        producer.close(timeout=10)
    return meta.partition, meta.offset


def read_all(bootstrap: str, topic: str, timeout_s: float = 30) -> list[Any]:
    """Every record now on ``topic`` (all partitions, from the beginning), in (partition, offset) order."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} to its end within {timeout_s}s"
            for batch in consumer.poll(timeout_ms=500).values():
                out.extend(decode(m.value) for m in batch)
        return out
    finally:
        consumer.close()
