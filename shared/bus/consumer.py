"""The bus's consumer: a manual-commit group member that yields decoded records, and one-off readers.

Every consumer keeps its offsets in one :class:`shared.offsets.Offsets`: re-deliveries
are filtered out of :meth:`Consumer.poll`, a rebalance drops and rebuilds the state of
the partitions it moves (and tells the service through its hooks), and
:meth:`Consumer.commit` commits only past records the service marked done. Malformed
records are counted, logged, marked done and skipped through one hook, never raised.
:func:`read_at` and :func:`read_topic` read without a group (references, tools, tests).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from shared import log
from shared.bus.client import DecodeHook, Polled, RebalanceHook, connect, servers
from shared.codec import DecodeError, decode
from shared.offsets import Offsets
from shared.offsets import TopicPartition as TP
from shared.schemas import Record
from shared.settings import KafkaSettings

_log = log.get(__name__)

IDLE_FETCH_MAX_WAIT_MS = 500
"""Longest an idle consumer's fetch waits (Kafka's default): any record ends it at once."""


def fetch_limits(settings: KafkaSettings, idle: bool) -> tuple[int, int]:
    """``(fetch_min_bytes, fetch_max_wait_ms)`` for a consumer's next fetches.

    The configured pair batches a busy topic (with a ``fetch_min_bytes`` above 1 the broker holds each
    fetch until it has that much or ``fetch_max_wait_ms`` passed). On a quiet topic that pair is a poll
    loop: every fetch waits out ``fetch_max_wait_ms`` and returns empty, 50 a second at 20 ms, each
    costing the consumer and the broker CPU. So after a poll that returned nothing the consumer asks for
    one byte with a long wait instead: the broker answers as soon as a record arrives (no later than the
    batched fetch would) and, until one does, twice a second."""
    if not idle:
        return settings.fetch_min_bytes, settings.fetch_max_wait_ms
    return 1, max(settings.fetch_max_wait_ms, IDLE_FETCH_MAX_WAIT_MS)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Forwards kafka-python's rebalance callbacks (run inside ``poll`` on the caller's thread)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.consumer._rebalanced("revoked", {(tp.topic, tp.partition) for tp in revoked})

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.consumer._rebalanced("assigned", {(tp.topic, tp.partition) for tp in assigned})


def _trail(topic: str, partition: int, last: int | None, offset: int, resumed: dict[str, int]) -> None:
    """What a group member's reading leaves in the log: where each partition starts in an assignment
    (``partitions_resumed``), and any offset skipped after that (compaction or retention; on a
    delete-policy topic, records lost to the client)."""
    if last is None:
        resumed[f"{topic}/{partition}"] = offset
    elif offset > last + 1:
        _log.info("offset_gap", topic=topic, partition=partition, after=last, offset=offset)


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
        self._in_group = group_id is not None
        subscribe_now = group_id is None  # without a group there is no rebalance to listen to
        self._consumer: KafkaConsumer = connect(
            lambda: KafkaConsumer(
                *(topics if subscribe_now else ()),
                bootstrap_servers=servers(settings),
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
                fetch_min_bytes=settings.fetch_min_bytes,
                fetch_max_wait_ms=settings.fetch_max_wait_ms,
                partition_assignment_strategy=(RangePartitionAssignor,),
            ),
            "consumer",
            settings,
        )
        if not subscribe_now and topics:
            self.subscribe(topics)
        fetcher: Any = self._consumer._fetcher  # its config is read for each fetch
        self._fetch_config: dict[str, Any] = fetcher.config
        self._idle: bool | None = None
        self._set_idle(True)

    def _set_idle(self, idle: bool) -> None:
        """Switch the next fetches between the batched and the idle limits (:func:`fetch_limits`)."""
        if idle != self._idle:
            self._idle = idle
            min_bytes, max_wait_ms = fetch_limits(self._settings, idle)
            self._fetch_config.update(fetch_min_bytes=min_bytes, fetch_max_wait_ms=max_wait_ms)

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
        self._set_idle(not batches)
        if self._hook_error is not None:
            exc, self._hook_error = self._hook_error, None
            raise exc
        out: list[Polled] = []
        resumed: dict[str, int] = {}
        for tp, messages in batches.items():
            pos = (tp.topic, tp.partition)
            for msg in messages:
                last = self.offsets.last(pos)
                if not self.offsets.deliver(pos, msg.offset):
                    continue
                if self._in_group:
                    _trail(tp.topic, tp.partition, last, msg.offset, resumed)
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
        if resumed:
            _log.info("partitions_resumed", offsets=resumed)
        return out

    def done(self, topic: str, partition: int, offset: int) -> None:
        """The work of the record at this position is durable (idempotent; stale positions are no-ops)."""
        self.offsets.done((topic, partition), offset)

    def commit(self) -> bool:
        """Commit every partition's position past its done records (see :mod:`shared.offsets`).

        Returns False when Kafka refused or missed it (the group rebalanced, e.g. after a broker
        restart, or the broker is down). Not an error for rein's consumers: they are at least
        once with idempotent handling, so the records are simply read again. Bounded by
        ``request_timeout_ms``: kafka-python's own commit waits for a coordinator without end,
        which would stall the service's loop for as long as the broker is down."""
        positions = self.offsets.to_commit()
        if not positions:
            return True
        try:
            self._consumer.commit(
                {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in positions.items()},
                timeout_ms=self._settings.request_timeout_ms,
            )
        except KafkaError as exc:
            _log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}"[:300], partitions=len(positions))
            return False
        self.offsets.committed(positions)
        return True

    def close(self) -> None:
        """Leave the group (a best effort bounded by ``close_timeout_ms``) and close."""
        self._consumer.close(autocommit=False, timeout_ms=self._settings.close_timeout_ms)


def read_at(settings: KafkaSettings, topic: str, partition: int, offset: int, timeout_s: float = 10.0) -> Record:
    """Fetch the single record at ``topic/partition/offset`` (group references in manifests)."""
    consumer: KafkaConsumer = connect(
        lambda: KafkaConsumer(
            bootstrap_servers=servers(settings),
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
