"""Kafka helpers: idempotent producer, manual-commit consumer, topic creation.

The thin adapter between services and kafka-python (STYLE 4): services hand in
and get back typed records (``shared.schemas``); malformed records are counted,
logged, marked done and skipped through one hook, never raised into a service loop.
Every consumer keeps its offsets in one :class:`shared.offsets.Offsets`: re-deliveries
are filtered out of :meth:`Consumer.poll`, a rebalance drops and rebuilds the state of
the partitions it moves (and tells the service through its hooks), and
:meth:`Consumer.commit` commits only past records the service marked done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import KafkaError, NoBrokersAvailable, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from shared import log
from shared.names import Topics
from shared.offsets import Offsets
from shared.offsets import TopicPartition as TP
from shared.schemas import DEFAULT_MAX_BYTES, DecodeError, Record, decode, encode
from shared.settings import KafkaSettings
from shared.topology import topic_specs

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
RebalanceHook = Callable[[set[TP]], None]


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

    def wait(self, future: object, timeout_s: float | None = None) -> Delivered:
        """The record's position once acked; BusUnavailable after ``timeout_s`` (default: request_timeout_ms)."""
        try:
            meta = future.get(timeout=self._timeout_s if timeout_s is None else timeout_s)  # type: ignore[attr-defined]
        except KafkaError as exc:
            raise BusUnavailable(f"producing to Kafka failed: {exc}") from exc
        return Delivered(meta.topic, meta.partition, meta.offset)

    def send_many(self, items: Iterable[tuple[str, Record]], timeout_s: float | None = None) -> list[Delivered]:
        """Produce several records and wait for all acks, within one overall bound (default:
        request_timeout_ms) however many there are; order per partition is kept."""
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        futures = [self.send_async(topic, record) for topic, record in items]
        return [self.wait(f, max(0.0, deadline - time.monotonic())) for f in futures]

    def flush(self) -> None:
        self._producer.flush(timeout=self._timeout_s)

    def close(self) -> None:
        self._producer.close(timeout=self._timeout_s)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Forwards kafka-python's rebalance callbacks (run inside ``poll`` on the caller's thread)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.consumer._rebalanced("revoked", {(tp.topic, tp.partition) for tp in revoked})

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.consumer._rebalanced("assigned", {(tp.topic, tp.partition) for tp in assigned})


class Consumer:
    """Consumer-group member with manual commit; yields decoded new records, skips poison ones.

    With a ``group_id`` the topics are subscribed with a rebalance listener and the Range
    assignor pinned (co-partitioned topics, such as ``rollout.chunks`` and ``rollout.events``,
    move together). ``on_revoked`` / ``on_assigned`` run inside :meth:`poll`, after the offset
    state was dropped / rebuilt and before any record of the new assignment is returned; an
    exception in one is raised from :meth:`poll` (kafka-python would only log it).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        topics: Sequence[str],
        group_id: str | None,
        *,
        on_decode_error: DecodeHook | None = None,
        on_revoked: RebalanceHook | None = None,
        on_assigned: RebalanceHook | None = None,
        from_beginning: bool = True,
        client_suffix: str = "consumer",
        max_poll_records: int = 500,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
    ) -> None:
        self._settings = settings
        self._on_decode_error = on_decode_error
        self._hooks: dict[str, RebalanceHook | None] = {"revoked": on_revoked, "assigned": on_assigned}
        self._hook_error: BaseException | None = None
        self.offsets = Offsets()
        self.decode_errors = 0
        self.rebalances = 0
        subscribe_now = group_id is None  # without a group there is no rebalance to listen to
        self._consumer: KafkaConsumer = _connect(
            lambda: KafkaConsumer(
                *(topics if subscribe_now else ()),
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
                partition_assignment_strategy=(RangePartitionAssignor,),
            ),
            "consumer",
            settings,
        )
        if not subscribe_now and topics:
            self.subscribe(topics)

    def subscribe(self, topics: Sequence[str]) -> None:
        """Join the group on ``topics`` with the rebalance listener installed."""
        self._consumer.subscribe(topics=list(topics), listener=_Listener(self))

    @property
    def raw(self) -> KafkaConsumer:
        """The underlying client, for assignment / seek / lag queries."""
        return self._consumer

    def _rebalanced(self, what: str, tps: set[TP]) -> None:
        if what == "revoked":
            self.offsets.revoke(tps)
            self.rebalances += 1
        else:
            self.offsets.assign(tps)
        _log.info("partitions_" + what, partitions=sorted(f"{t}/{p}" for t, p in tps))
        hook = self._hooks[what]
        if hook is not None and self._hook_error is None:
            try:
                hook(tps)
            except BaseException as exc:  # kafka-python swallows listener errors; poll() re-raises it
                self._hook_error = exc

    def poll(self, timeout_s: float = 1.0) -> list[Polled]:
        """Decoded new records from one poll, in partition order.

        Re-deliveries of offsets already tracked in this assignment are dropped; malformed
        records go to the decode hook and are marked done (poison never holds a partition)."""
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        if self._hook_error is not None:
            exc, self._hook_error = self._hook_error, None
            raise exc
        out: list[Polled] = []
        for tp, messages in batches.items():
            pos = (tp.topic, tp.partition)
            for msg in messages:
                if not self.offsets.deliver(pos, msg.offset):
                    continue
                try:
                    record = decode(msg.value, self._settings.max_record_bytes)
                except DecodeError as exc:
                    self.decode_errors += 1
                    self.offsets.done(pos, msg.offset)
                    _log.warning(
                        "record_skipped", topic=tp.topic, partition=tp.partition, offset=msg.offset, error=str(exc)
                    )
                    if self._on_decode_error is not None:
                        self._on_decode_error(tp.topic, tp.partition, msg.offset, exc)
                    continue
                key = msg.key.decode("utf-8", errors="replace") if msg.key is not None else None
                out.append(Polled(tp.topic, tp.partition, msg.offset, key, record, msg.timestamp))
        return out

    def done(self, topic: str, partition: int, offset: int) -> None:
        """The work of the record at this position is durable (idempotent; stale positions are no-ops)."""
        self.offsets.done((topic, partition), offset)

    def commit(self) -> bool:
        """Commit every partition's position past its done records (see :mod:`shared.offsets`).

        Returns False when Kafka refused or missed it (the group rebalanced, e.g. after a broker
        restart, or the broker is down). Not an error for rein's consumers: they are at least
        once with idempotent handling, so the records are simply read again."""
        positions = self.offsets.to_commit()
        if not positions:
            return True
        try:
            self._consumer.commit(
                {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in positions.items()}
            )
        except KafkaError as exc:
            _log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}"[:300], partitions=len(positions))
            return False
        self.offsets.committed(positions)
        return True

    def close(self) -> None:
        self._consumer.close(autocommit=False)


def create_topics(
    admin: KafkaAdminClient,
    partitions: dict[str, int],
    configs: Mapping[str, Mapping[str, str]] | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create the missing topics (replication 1) and wait until every partition has a leader.

    ``configs`` maps a topic name to its topic configuration. Returns the names this call
    created. Waiting matters: a producer or an assigned consumer that races a fresh topic's
    leader election sees errors or stalls.
    """
    existing = set(admin.list_topics())
    created: list[str] = []
    for name, count in partitions.items():
        if name in existing:
            continue
        config = dict((configs or {}).get(name, {}))
        try:
            admin.create_topics(
                [NewTopic(name, count, 1, topic_configs=config)],
                timeout_ms=int(timeout_s * 1000),
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


def ensure_topology(
    settings: KafkaSettings, topics: Topics, partitions: int = 4, only: Iterable[str] | None = None
) -> list[str]:
    """Create the missing topics of ``topics`` as :func:`shared.topology.topic_specs` says (all, or
    ``only`` those names) and wait for their leaders; returns the ones created."""
    specs = topic_specs(topics, partitions)
    names = list(specs) if only is None else list(only)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"not rein topics: {unknown}")
    admin = admin_client(settings)
    try:
        return create_topics(
            admin, {n: specs[n].partitions for n in names}, {n: specs[n].configs for n in names}
        )
    finally:
        admin.close()


def topic_configs(settings: KafkaSettings, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """Each topic's effective configuration on the broker (its own and the broker's defaults)."""
    admin = admin_client(settings)
    try:
        wanted = list(names)
        responses = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in wanted])
    finally:
        admin.close()
    out: dict[str, dict[str, str]] = {}
    for response in responses:
        for error_code, error_message, _type, name, entries in (r[:5] for r in response.resources):
            if error_code:
                raise BusUnavailable(f"describing topic {name!r} failed: error {error_code} {error_message}")
            out[name] = {entry[0]: entry[1] for entry in entries if entry[1] is not None}
    missing = [n for n in wanted if n not in out]
    if missing:
        raise BusUnavailable(f"the broker described no configuration for topics {missing}")
    return out


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
