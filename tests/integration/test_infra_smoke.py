"""Smoke tests of the real services the session fixtures start: the guarantees rein relies on.

Kafka: an idempotent producer (acks=all) and a manually committed consumer group; a fresh consumer
of the same group resumes from the committed offset. Redis: a Lua script runs server-side.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition

pytestmark = pytest.mark.integration


def _consumer(bootstrap: str, group: str) -> KafkaConsumer:
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        consumer_timeout_ms=1_000,
    )


def _poll_records(consumer: KafkaConsumer, want: int, timeout_s: float = 30.0) -> list[object]:
    """Poll until ``want`` records arrived (the first poll also waits for the group assignment)."""
    import time

    records: list[object] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < want and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=500).values():
            records.extend(batch)
    return records


def test_idempotent_produce_and_manual_commit_resume(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str
) -> None:
    topic = unique_topic(1)
    tp = TopicPartition(topic, 0)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    try:
        meta = producer.send(topic, key=b"group-1", value=b"chunk-0").get(timeout=30)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)
    assert (meta.topic, meta.partition, meta.offset) == (topic, 0, 0)

    first = _consumer(kafka_bootstrap, unique_group)
    try:
        first.subscribe([topic])
        records = _poll_records(first, 1)
        assert [(r.key, r.value) for r in records] == [(b"group-1", b"chunk-0")]  # type: ignore[attr-defined]
        first.commit({tp: OffsetAndMetadata(records[-1].offset + 1, "", -1)})  # type: ignore[attr-defined]
    finally:
        first.close(autocommit=False)

    second = _consumer(kafka_bootstrap, unique_group)
    try:
        assert second.committed(tp) == 1
        second.subscribe([topic])
        assert _poll_records(second, 1, timeout_s=5.0) == []  # resumes after the committed record
    finally:
        second.close(autocommit=False)


def test_lua_script_round_trip(redis_client: redis.Redis) -> None:
    redis_client.set("counter", 40)
    add = redis_client.register_script(
        "local v = redis.call('INCRBY', KEYS[1], ARGV[1]) redis.call('SET', KEYS[2], v * 2) return {v, v * 2}"
    )
    assert add(keys=["counter", "double"], args=[2]) == [42, 84]
    assert redis_client.get("double") == b"84"
    assert redis_client.eval("return redis.call('GET', KEYS[1])", 1, "counter") == b"42"
