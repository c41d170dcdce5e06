"""Helpers of the collector integration tests (no tests here): settings, topic tails, a replica in a thread.

Every test gets its own topic names (``t.<uuid>.<name>``), its own Redis logical DB and key
prefix, and its own consumer group, so tests never see each other's records or window.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from kafka import TopicPartition

from services.collector.service import Collector
from services.collector.settings import CollectorSettings
from services.collector.synthetic import ChunkSpec, group_records
from shared.bus import Consumer, Producer, ensure_topology
from shared.bus.admin import admin_client
from shared.names import RedisKeys, Topics
from shared.schemas import BatchManifest, Chunk, DecisionRecord, Record, RetryRequest, WeightPublished
from shared.settings import KafkaSettings, RedisSettings

WAIT_S = 60.0


def make_settings(kafka_bootstrap: str, redis_url: str, *, partitions: int = 1, **overrides: Any) -> CollectorSettings:
    """Settings of a fresh deployment: unique topics, key prefix and consumer group; topics created.

    ``no_signal_groups`` is ``keep`` unless overridden: :func:`group_records` gives every trajectory
    the same reward by default, and most tests here are about the version window, not about signal.
    """
    tag = uuid.uuid4().hex[:10]
    topics = Topics(**{name: f"t.{tag}.{name}" for name in Topics.model_fields})
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, client_id=f"test-{tag}")
    ensure_topology(kafka, topics, partitions)
    values: dict[str, Any] = {
        "kafka": kafka,
        "redis": RedisSettings(url=redis_url, key_prefix=f"test-{tag}"),
        "topics": topics,
        "consumer_group": f"collector-{tag}",
        "metrics_port": 0,
        "poll_timeout_s": 0.05,
        "drain_interval_s": 0.5,
        "outbox_lock_ms": 2_000,
        "topic_partitions": partitions,
        "batch_groups": 100,
        "keep_versions": 2,
        "no_signal_groups": "keep",
    }
    values.update(overrides)
    return CollectorSettings(**values)


def env_of(settings: CollectorSettings) -> dict[str, str]:
    """The ``REIN_*`` environment that reproduces ``settings`` in a subprocess."""
    env = {
        "REIN_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "REIN_KAFKA__CLIENT_ID": settings.kafka.client_id,
        "REIN_REDIS__URL": settings.redis.url,
        "REIN_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "REIN_LOG_JSON": "true",
    }
    for name in Topics.model_fields:
        env[f"REIN_TOPICS__{name.upper()}"] = getattr(settings.topics, name)
    for name in (
        "consumer_group",
        "keep_versions",
        "batch_groups",
        "max_retries",
        "metrics_port",
        "poll_timeout_s",
        "drain_interval_s",
        "outbox_lock_ms",
        "topic_partitions",
        "incomplete_timeout_s",
        "no_signal_groups",
    ):
        env[f"REIN_{name.upper()}"] = str(getattr(settings, name))
    return env


class Source:
    """Plays the proxy, the rollout runner and the broadcaster: writes records to the input topics."""

    def __init__(self, settings: CollectorSettings, weights: Sequence[str] = ()) -> None:
        """``weights``: the versions the broadcaster has published before the test begins (:meth:`weights`)."""
        self.topics = settings.topics
        self.producer = Producer(settings.kafka, client_suffix="test-source")
        if weights:
            self.weights(weights)

    def weights(self, labels: Sequence[str], first_seq: int = 0) -> None:
        self.producer.send_many(
            (
                self.topics.weights,
                WeightPublished(version=label, seq=first_seq + i, path=f"/w/{label}", digest="d", step=i),
            )
            for i, label in enumerate(labels)
        )

    def records(self, records: Iterable[Record]) -> None:
        self.producer.send_many(
            (self.topics.chunks if isinstance(r, Chunk) else self.topics.events, r) for r in records
        )

    def group(self, group_id: str, trajectories: Sequence[Sequence[ChunkSpec]], **kw: Any) -> None:
        self.records(group_records(group_id, trajectories, **kw))

    def close(self) -> None:
        self.producer.close()


class Tail:
    """Reads a topic from the beginning (all partitions, no consumer group) and keeps everything."""

    def __init__(self, settings: CollectorSettings, topic: str) -> None:
        self.consumer = Consumer(settings.kafka, (), None, client_suffix="test-tail")
        raw = self.consumer.raw
        parts = None
        deadline = time.monotonic() + WAIT_S
        while not parts and time.monotonic() < deadline:
            raw.poll(timeout_ms=100)
            parts = raw.partitions_for_topic(topic)
        assert parts, f"topic {topic} has no partitions"
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        raw.assign(tps)
        raw.seek_to_beginning(*tps)
        self.records: list[Record] = []

    def poll(self) -> list[Record]:
        self.records.extend(p.record for p in self.consumer.poll(0.1))
        return self.records

    def wait(self, until: Callable[[list[Record]], bool], what: str, timeout_s: float = WAIT_S) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        while not until(self.poll()):
            if time.monotonic() > deadline:
                # where is the collector? (pytest captures sys.stderr)
                faulthandler.dump_traceback(file=sys.__stderr__ or sys.stderr, all_threads=True)
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; have {len(self.records)}")
        return self.records

    def read_to_end(self, timeout_s: float = WAIT_S) -> list[Record]:
        """Poll until every partition is read up to its end offset as of this call."""
        raw = self.consumer.raw
        ends = raw.end_offsets(list(raw.assignment()))
        deadline = time.monotonic() + timeout_s
        while any(raw.position(tp) < end for tp, end in ends.items()):
            assert time.monotonic() < deadline, f"not read to the end offsets {ends} within {timeout_s}s"
            self.poll()
        return self.records

    def close(self) -> None:
        self.consumer.close()


def wait_settled(settings: CollectorSettings, tails: Sequence[Tail], timeout_s: float = WAIT_S) -> None:
    """Wait until the collectors can publish nothing more that ``tails`` have not read, so counting
    duplicates there is final: the consumer group has committed every record of its input topics (no
    replica reads and decides one again), the Redis outbox is empty (its entries are trimmed only after
    Kafka acked them), and then each tail has read its topic to the end."""
    raw = tails[0].consumer.raw
    inputs = [TopicPartition(topic, p) for topic in (settings.topics.chunks, settings.topics.events)
              for p in sorted(raw.partitions_for_topic(topic) or ())]
    admin = admin_client(settings.kafka)
    client = redis.Redis.from_url(settings.redis.url, socket_timeout=10)
    outbox = RedisKeys(settings.redis.key_prefix).outbox
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            offsets = admin.list_consumer_group_offsets(settings.consumer_group)
            committed = {tp: meta.offset for tp, meta in offsets.items()}
            ends = raw.end_offsets(inputs)
            behind = {f"{tp.topic}/{tp.partition}": (committed.get(tp), end) for tp, end in ends.items()
                      if committed.get(tp, -1) < end}
            queued = int(client.llen(outbox))
            if not behind and not queued:
                break
            assert time.monotonic() < deadline, (
                f"not settled within {timeout_s}s: (committed, end) {behind}, {queued} outbox entries"
            )
            time.sleep(0.1)  # offsets and the outbox are polled: neither has an event to wait on
    finally:
        admin.close()
        client.close()
    for tail in tails:
        tail.read_to_end(max(1.0, deadline - time.monotonic()))


def final_decisions(records: Iterable[Record]) -> dict[str, str]:
    """group id -> its last decision (by window step)."""
    best: dict[str, tuple[int, str]] = {}
    for r in records:
        if isinstance(r, DecisionRecord):
            step = -1 if r.step is None else r.step
            if r.group_id not in best or step >= best[r.group_id][0]:
                best[r.group_id] = (step, r.decision)
    return {gid: d for gid, (_, d) in best.items()}


def decided(tail: Tail, group_ids: list[str]) -> dict[str, str]:
    """Wait until every group of ``group_ids`` has a decision on ``tail``; every group's final decision."""
    records = tail.wait(lambda rs: set(group_ids) <= set(final_decisions(rs)), f"decisions of {group_ids}")
    return final_decisions(records)


def steps_of(records: Iterable[Record], group_id: str) -> list[tuple[int | None, str]]:
    """``(window step, decision)`` of every decision ``group_id`` got, in the order read."""
    return [(r.step, r.decision) for r in records if isinstance(r, DecisionRecord) and r.group_id == group_id]


def manifests_by_index(records: Iterable[Record]) -> dict[int, BatchManifest]:
    """Manifests deduplicated by index; a duplicate must be identical (same key, same content)."""
    out: dict[int, BatchManifest] = {}
    for r in records:
        if isinstance(r, BatchManifest):
            held = out.setdefault(r.index, r)
            assert held == r, f"two different manifests with index {r.index}"
    return out


def distinct_retries(records: Iterable[Record]) -> list[RetryRequest]:
    """Retry requests deduplicated, in order; a duplicate must be identical. The outbox publishes at least
    once: a publish that timed out after the broker took it is published again as the same bytes (as
    under a loaded CI run with the tests' 1 s send bound), and the runner keys a retry by prompt and
    attempt, so it plays each once."""
    out: dict[tuple[str, int, str], RetryRequest] = {}
    for r in records:
        if isinstance(r, RetryRequest):
            held = out.setdefault((r.prompt_id, r.attempt, r.previous_group_id), r)
            assert held == r, f"two different retry requests for {r.prompt_id} attempt {r.attempt}"
    return list(out.values())


class Running:
    """One collector replica in a thread of this process; ``stop()`` re-raises what killed it."""

    def __init__(self, settings: CollectorSettings) -> None:
        self.stop_event = threading.Event()
        self.collector = Collector(settings, self.stop_event)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="collector-under-test", daemon=True)

    def _run(self) -> None:
        try:
            self.collector.run()
        except BaseException as exc:
            self.error = exc
            raise

    def __enter__(self) -> Running:
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.collector.ready.wait(0.1):
            if self.error is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"collector did not start: {self.error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "collector thread did not stop"
        if self.error is not None:
            raise self.error

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.collector.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value
