"""A consumer tuned to batch a busy topic (``fetch_min_bytes`` above 1, a short ``fetch_max_wait_ms``) on the real
broker: idle, it does not poll the broker every ``fetch_max_wait_ms``; a record still reaches it at once."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from kafka import KafkaProducer

from shared.bus.consumer import Consumer
from shared.settings import KafkaSettings

pytestmark = pytest.mark.integration



def _fetch_metrics(consumer: Consumer) -> dict[str, float]:
    metrics: dict[str, dict[str, float]] = consumer.raw.metrics()
    return metrics["consumer-fetch-manager-metrics"]


def test_an_idle_batched_consumer_waits_long_and_wakes_on_a_record(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str
) -> None:
    topic = unique_topic(1)
    batched = KafkaSettings(bootstrap_servers=kafka_bootstrap, fetch_min_bytes=65536, fetch_max_wait_ms=20)  # the
    consumer = Consumer(batched, [topic], unique_group, from_beginning=False)  # local stack's collectors (TUNING)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    try:
        deadline = time.monotonic() + 30
        while not consumer.raw.assignment():  # joined, and fetching from the end of the empty topic
            assert time.monotonic() < deadline, "no assignment within 30 s"
            consumer.poll(0.2)
        idle_until = time.monotonic() + 3
        while time.monotonic() < idle_until:
            assert consumer.poll(0.2) == []
        latency_ms = _fetch_metrics(consumer)["fetch-latency-avg"]
        # batched, every empty fetch would end after 20 ms: about 50 a second, each answered empty
        assert latency_ms > 250, f"idle fetches ended after {latency_ms:.0f} ms on average: a poll loop"

        # any record will do: one that is not rein's is counted as a decode error when it arrives
        sent = time.monotonic()
        producer.send(topic, b"not a rein record").get(timeout=30)
        while not consumer.decode_errors and time.monotonic() - sent < 5:
            consumer.poll(0.05)
        waited = time.monotonic() - sent
        assert consumer.decode_errors == 1, "the record did not arrive within 5 s"
        assert waited < 0.4, f"a record sent to an idle consumer took {waited:.2f} s (its fetch waited out 500 ms)"
    finally:
        producer.close(timeout=10)
        consumer.close()
