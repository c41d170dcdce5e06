"""Smoke test of the real broker the session fixtures start: the guarantee rein's consumers rely on.

An idempotent producer (acks=all) and a manually committed consumer group; a fresh consumer of the
same group resumes from the committed offset. (Redis's server-side scripts are exercised through
rein's own registry in ``tests/integration/shared/test_state.py``.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
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
        assert (meta.topic, meta.partition, meta.offset) == (topic, 0, 0)

        first = _consumer(kafka_bootstrap, unique_group)
        try:
            first.subscribe([topic])
            records = _poll_records(first, 1)
            assert [(r.key, r.value) for r in records] == [(b"group-1", b"chunk-0")]  # type: ignore[attr-defined]
            first.commit({tp: OffsetAndMetadata(records[-1].offset + 1, "", -1)})  # type: ignore[attr-defined]
        finally:
            first.close(autocommit=False)
        # a second record after the commit: the group's next member must start exactly there
        producer.send(topic, key=b"group-1", value=b"chunk-1").get(timeout=30)
    finally:
        producer.close(timeout=10)

    second = _consumer(kafka_bootstrap, unique_group)
    try:
        assert second.committed(tp) == 1
        second.subscribe([topic])
        resumed = _poll_records(second, 1)
        assert [(r.offset, r.value) for r in resumed] == [(1, b"chunk-1")]  # type: ignore[attr-defined]
    finally:
        second.close(autocommit=False)
