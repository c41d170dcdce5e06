"""The bus's producer sends to every partition again after its broker was killed and restarted.

kafka-python 2.3's idempotent sender can leave partitions muted for good after an outage long enough
for deliveries to expire (see :mod:`shared.bus.producer`): every later record to them expires while
the broker answers. Here a broker of the test's own is killed (SIGKILL) under a steady load on four
partitions and restarted; with a 3 s request timeout, its ~10 s restart expires deliveries, which
without the producer's replacement left every partition stuck in each run tried.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ops.local.launcher import Infra
from shared.bus import Producer
from shared.bus.admin import admin_client, create_topics
from shared.schemas import RetryRequest
from shared.settings import KafkaSettings
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

TOPIC = "recovery"
PARTITIONS = 4


def _keys_per_partition(producer: Producer) -> dict[int, str]:
    """One key for each partition, found by producing (the partitioner decides)."""
    keys: dict[int, str] = {}
    for i in range(200):
        probe = RetryRequest(prompt_id=f"p{i}", attempt=0, previous_group_id="g")
        delivered = producer.send(TOPIC, probe, key=f"k{i}")
        keys.setdefault(delivered.partition, f"k{i}")
        if len(keys) == PARTITIONS:
            return keys
    raise AssertionError(f"200 keys reached only partitions {sorted(keys)}")


def test_every_partition_takes_records_after_the_broker_is_killed_and_restarted(tmp_path: Path) -> None:
    infra = Infra.start(tmp_path / "infra")
    try:
        settings = KafkaSettings(bootstrap_servers=infra.kafka_bootstrap, request_timeout_ms=3000)
        admin = admin_client(settings)
        try:
            create_topics(admin, {TOPIC: PARTITIONS})
        finally:
            admin.close()
        producer = Producer(settings, client_suffix="recovery")
        keys = _keys_per_partition(producer)
        lock = threading.Lock()
        last_ack = dict.fromkeys(keys, 0.0)
        sent = answered = 0
        stop = threading.Event()

        def pump() -> None:
            nonlocal sent
            while not stop.is_set():
                for partition, key in keys.items():
                    def done(error: BaseException | None, partition: int = partition) -> None:
                        nonlocal answered
                        with lock:
                            answered += 1
                            if error is None:
                                last_ack[partition] = time.monotonic()
                    with lock:
                        sent += 1
                    producer.send_encoded(TOPIC, b"x" * 300, key, done)
                stop.wait(0.02)

        thread = threading.Thread(target=pump, name="pump", daemon=True)
        thread.start()
        wait_until(lambda: min(last_ack.values()) > 0, 30, "every partition acked before the kill")
        infra.restart("kafka", kill=True, down_s=0.0)
        back = time.monotonic()

        def stuck() -> list[int]:
            with lock:
                return [p for p, t in last_ack.items() if t <= back]

        wait_until(lambda: not stuck(), 120, "every partition acked again after the restart",
                   details=lambda: f"partitions without an ack since the restart: {stuck()}; "
                                   f"clients replaced: {producer.replacements}")
        stop.set()
        thread.join(10)
        producer.flush()
        # nothing silently lost: every record was answered, acked or failed
        wait_until(lambda: answered == sent, 30, "an answer for every record",
                   details=lambda: f"{sent} sent, {answered} answered")
        producer.close()
        # every client closed, the replaced ones too: none of their I/O threads outlives them
        wait_until(lambda: not _network_threads(), 30, "no Kafka producer I/O thread left",
                   details=lambda: f"alive: {_network_threads()}; clients replaced: {producer.replacements}")
    finally:
        infra.stop()


def _network_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rein-recovery") and t.is_alive()]
