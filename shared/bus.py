"""Kafka helpers: idempotent producer, manual-commit consumer, topic creation.

The thin adapter between services and kafka-python (STYLE 4): services hand in
and get back typed records (``shared.schemas``); malformed records are counted,
logged and skipped through one hook, never raised into a service loop; offsets
are committed only when the caller says its output is durable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, NoBrokersAvailable, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from shared import log
from shared.schemas import DEFAULT_MAX_BYTES, DecodeError, Record, decode, encode
from shared.settings import KafkaSettings

_log = log.get(__name__)



class BusUnavailable(RuntimeError):
    """The Kafka broker could not be reached within the configured bound."""


@dataclass(frozen=True)
class Delivered:
    """Where a produced record landed."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class Polled:
    """A decoded record with its position, for commit bookkeeping and references."""

    topic: str
    partition: int
    offset: int
    key: str | None
    record: Record
    timestamp_ms: int


DecodeHook = Callable[[str, int, int, DecodeError], None]


def _servers(settings: KafkaSettings) -> list[str]:
    return [s.strip() for s in settings.bootstrap_servers.split(",") if s.strip()]


def _connect(factory: Callable[[], object], what: str, settings: KafkaSettings, attempts: int = 5) -> object:
    """Build a client, retrying a bounded number of times on an unreachable broker."""
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            return factory()
        except NoBrokersAvailable as exc:
            if attempt == attempts:
                raise BusUnavailable(
                    f"{what}: no Kafka broker answered at {settings.bootstrap_servers} after {attempts} attempts"
                ) from exc
            _log.warning("kafka_unavailable", what=what, attempt=attempt, retry_in_s=delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")


class Producer:
    """Idempotent producer (acks=all); ``send`` returns once the broker has the record."""

    def __init__(self, settings: KafkaSettings, client_suffix: str = "producer") -> None:
        self._settings = settings
        self._timeout_s = settings.request_timeout_ms / 1000
        self._producer: KafkaProducer = _connect(
            lambda: KafkaProducer(
                bootstrap_servers=_servers(settings),
                client_id=f"{settings.client_id}-{client_suffix}",
                acks="all",
                enable_idempotence=True,
                linger_ms=2,
                request_timeout_ms=settings.request_timeout_ms,
                max_request_size=min(settings.max_record_bytes, DEFAULT_MAX_BYTES),
            ),
            "producer",
            settings,
        )

    def send(self, topic: str, record: Record, key: str | None = None) -> Delivered:
        """Produce one record and wait for the broker's ack (bounded by request_timeout_ms)."""
        future = self.send_async(topic, record, key)
        return self.wait(future)

    def send_async(self, topic: str, record: Record, key: str | None = None) -> object:
        """Queue one record; pair with :meth:`wait` or :meth:`flush`."""
        # keys are encoded here: kafka-python 3 deprecates plain callables as serializers
        text = key if key is not None else record.key()
        return self._producer.send(topic, value=encode(record), key=text.encode("utf-8"))

    def wait(self, future: object) -> Delivered:
        try:
            meta = future.get(timeout=self._timeout_s)  # type: ignore[attr-defined]
        except KafkaError as exc:
            raise BusUnavailable(f"producing to Kafka failed: {exc}") from exc
        return Delivered(meta.topic, meta.partition, meta.offset)

    def send_many(self, items: Iterable[tuple[str, Record]]) -> list[Delivered]:
        """Produce several records and wait for all acks; order per partition is kept."""
        futures = [self.send_async(topic, record) for topic, record in items]
        return [self.wait(f) for f in futures]

    def flush(self) -> None:
        self._producer.flush(timeout=self._timeout_s)

    def close(self) -> None:
        self._producer.close(timeout=self._timeout_s)


class Consumer:
    """Consumer-group member with manual commit; yields decoded records, skips poison ones."""

    def __init__(
        self,
        settings: KafkaSettings,
        topics: Sequence[str],
        group_id: str | None,
        *,
        on_decode_error: DecodeHook | None = None,
        from_beginning: bool = True,
        client_suffix: str = "consumer",
        max_poll_records: int = 500,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
    ) -> None:
        self._settings = settings
        self._on_decode_error = on_decode_error
        self.decode_errors = 0
        self._consumer: KafkaConsumer = _connect(
            lambda: KafkaConsumer(
                *topics,
                bootstrap_servers=_servers(settings),
                client_id=f"{settings.client_id}-{client_suffix}",
                group_id=group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest" if from_beginning else "latest",
                max_poll_records=max_poll_records,
                session_timeout_ms=session_timeout_ms,
                heartbeat_interval_ms=heartbeat_interval_ms,
                request_timeout_ms=max(settings.request_timeout_ms, session_timeout_ms + 5_000),
                fetch_max_bytes=max(settings.max_record_bytes, 1024 * 1024) * 4,
                max_partition_fetch_bytes=max(settings.max_record_bytes, 1024 * 1024),
            ),
            "consumer",
            settings,
        )

    @property
    def raw(self) -> KafkaConsumer:
        """The underlying client, for assignment / seek / lag queries."""
        return self._consumer

    def poll(self, timeout_s: float = 1.0) -> list[Polled]:
        """Decoded records from one poll, in partition order; malformed ones go to the hook."""
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        out: list[Polled] = []
        for tp, messages in batches.items():
            for msg in messages:
                try:
                    record = decode(msg.value, self._settings.max_record_bytes)
                except DecodeError as exc:
                    self.decode_errors += 1
                    _log.warning(
                        "record_skipped", topic=tp.topic, partition=tp.partition, offset=msg.offset, error=str(exc)
                    )
                    if self._on_decode_error is not None:
                        self._on_decode_error(tp.topic, tp.partition, msg.offset, exc)
                    continue
                key = msg.key.decode("utf-8", errors="replace") if msg.key is not None else None
                out.append(Polled(tp.topic, tp.partition, msg.offset, key, record, msg.timestamp))
        return out

    def commit(self, offsets: dict[tuple[str, int], int]) -> bool:
        """Commit ``(topic, partition) -> next offset to read`` (the last handled offset + 1).

        Returns False when Kafka refused or missed it (the group rebalanced, e.g. after a broker
        restart, or the broker is down). Not an error for rein's consumers: they are at least
        once with idempotent handling, so the records are simply read again."""
        if not offsets:
            return True
        try:
            self._consumer.commit(
                {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
            )
        except KafkaError as exc:
            _log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}"[:300], partitions=len(offsets))
            return False
        return True

    def close(self) -> None:
        self._consumer.close(autocommit=False)


def create_topics(
    admin: KafkaAdminClient,
    partitions: dict[str, int],
    configs: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create the missing topics (replication 1) and wait until every partition has a leader.

    Returns the names this call created. Waiting matters: a producer or an assigned
    consumer that races a fresh topic's leader election sees errors or stalls.
    """
    existing = set(admin.list_topics())
    created: list[str] = []
    for name, count in partitions.items():
        if name in existing:
            continue
        try:
            admin.create_topics(
                [NewTopic(name, count, 1, topic_configs=dict(configs or {}))], timeout_ms=int(timeout_s * 1000)
            )
            created.append(name)
        except TopicAlreadyExistsError:
            pass
    deadline = time.monotonic() + timeout_s
    # A topic that already existed keeps its own partition count; only new ones must reach theirs.
    waiting = {name: (count if name in created else 1) for name, count in partitions.items()}
    while waiting:
        for meta in admin.describe_topics(list(waiting)):
            parts = meta.get("partitions") or []
            if meta.get("error_code", 0) == 0 and len(parts) >= waiting.get(meta["topic"], 1) and all(
                p.get("leader", -1) >= 0 for p in parts
            ):
                waiting.pop(meta["topic"], None)
        if waiting:
            if time.monotonic() > deadline:
                raise BusUnavailable(f"topics {sorted(waiting)} have no leader after {timeout_s}s")
            time.sleep(0.1)
    return created


def admin_client(settings: KafkaSettings) -> KafkaAdminClient:
    """An admin client on the configured brokers (bounded connection attempts)."""
    client: KafkaAdminClient = _connect(
        lambda: KafkaAdminClient(
            bootstrap_servers=_servers(settings),
            client_id=f"{settings.client_id}-admin",
            request_timeout_ms=settings.request_timeout_ms,
        ),
        "admin",
        settings,
    )
    return client


def ensure_topics(settings: KafkaSettings, topics: Iterable[str], partitions: int = 4) -> list[str]:
    """Create missing topics with ``partitions`` each and wait for their leaders; returns the ones created."""
    admin = admin_client(settings)
    try:
        return create_topics(admin, dict.fromkeys(topics, partitions))
    finally:
        admin.close()


def read_at(settings: KafkaSettings, topic: str, partition: int, offset: int, timeout_s: float = 10.0) -> Record:
    """Fetch the single record at ``topic/partition/offset`` (group references in manifests)."""
    consumer: KafkaConsumer = _connect(
        lambda: KafkaConsumer(
            bootstrap_servers=_servers(settings),
            client_id=f"{settings.client_id}-reader",
            group_id=None,
            enable_auto_commit=False,
            max_partition_fetch_bytes=max(settings.max_record_bytes, 1024 * 1024),
        ),
        "reader",
        settings,
    )
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msg in consumer.poll(timeout_ms=500, max_records=1).get(tp, []):
                if msg.offset == offset:
                    return decode(msg.value, settings.max_record_bytes)
        raise LookupError(f"no record at {topic}/{partition}@{offset} within {timeout_s}s")
    finally:
        consumer.close()


def read_topic(settings: KafkaSettings, topic: str, timeout_s: float) -> list[Record]:
    """Every decodable record of ``topic`` up to its current end, without a consumer group."""
    consumer = Consumer(settings, (), None, client_suffix="reader")
    raw = consumer.raw
    try:
        deadline = time.monotonic() + timeout_s
        parts = raw.partitions_for_topic(topic)
        while not parts:
            if time.monotonic() > deadline:
                raise LookupError(f"topic {topic!r} not found on {settings.bootstrap_servers}")
            raw.poll(timeout_ms=100)
            parts = raw.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        raw.assign(tps)
        raw.seek_to_beginning(*tps)
        end = raw.end_offsets(tps)
        out: list[Record] = []
        while any(raw.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic!r} to its end within {timeout_s}s")
            out.extend(p.record for p in consumer.poll(0.2))
        return out
    finally:
        consumer.close()
