"""The collector's main loop: Kafka in, one shared window in Redis, manifests out.

Consumes (consumer group ``group_id``): ``rollout.chunks`` and ``rollout.events``
(co-partitioned by group id, so one replica sees all records of a group). Follows
``weights`` on its own, from the beginning and without a group, so every replica
rebuilds the Redis registry from the topic (publish is idempotent). Produces:
``rollout.groups`` (every completed group: the audit log that manifests point
into), then through the Redis outbox ``staleness.decisions``, ``train.batches``
and ``rollout.retries``. Owns nothing in memory that Kafka cannot rebuild.

One iteration: poll -> fold records into the :class:`Assembler` -> for the groups
that completed: write them to ``rollout.groups``, run the atomic window step, drain
the outbox -> release the groups -> commit offsets (lowest still-needed offset per
partition). A crash anywhere re-reads every record of every group not released.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from kafka.errors import KafkaError

from services.collector.assembly import (
    Assembler,
    Position,
)
from services.collector.decision_report import DecisionReport
from services.collector.metrics import CollectorMetrics
from services.collector.settings import CollectorSettings
from services.collector.weights_follower import WeightsFollower
from services.collector.window_store import WindowStore
from shared import log
from shared.bus import Consumer, Delivered, Polled, Producer, ensure_topology, topic_configs
from shared.codec import DecodeError
from shared.names import RedisKeys
from shared.outage import DEPENDENCY_ERRORS, Outage
from shared.schemas import CompletedGroup, GroupRef, Record
from shared.staleness import WindowSettings
from shared.state import Replication, connect
from shared.status_server import StatusServer
from shared.topology import TopicSpec
from shared.window_view import window_group

_log = log.get(__name__)

_LOOP_ERRORS: tuple[type[BaseException], ...] = (*DEPENDENCY_ERRORS, TimeoutError)
"""What one loop iteration waits out and redoes (TimeoutError: the weights catch-up, the outbox lease)."""


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Collector:
    """One replica. ``run(stop)`` loops until ``stop`` is set; every component is built here and passed down."""

    def __init__(self, settings: CollectorSettings, stop: threading.Event | None = None) -> None:
        self.settings = settings
        self.stop = stop or threading.Event()
        self.replica = settings.replica_id or default_replica_id()
        self.metrics = CollectorMetrics()
        self.config: WindowSettings = settings  # the window's own settings, part of the collector's
        self.assembler = Assembler()
        self.report = DecisionReport(self.metrics, self.config)
        self.last_loop = time.monotonic()
        self.ready = threading.Event()
        self.http: StatusServer | None = None
        self._caught_up_for: set[str] = set()
        self._unfolded: list[Polled] = []
        self._backlog: list[CompletedGroup] = []

    # ------------------------------------------------------------------ wiring

    def run(self) -> None:
        s = self.settings
        topics = s.topics
        ensure_topology(s.kafka, topics, s.topic_partitions)
        self._check_decided_ttl()
        redis_client = connect(s.redis)
        self.store = WindowStore(
            redis_client,
            RedisKeys(s.redis.key_prefix),
            topics,
            self.config,
            replica=self.replica,
            lock_ms=s.outbox_lock_ms,
            replication=Replication.of(s.redis),
        )
        self.store.claim_config(overwrite=s.reconfigure)
        self.producer = Producer(s.kafka, client_suffix=f"collector-{self.replica}")
        self.weights = WeightsFollower(s, self.store.registry, self.metrics)
        # Join the group only once the input topics' metadata is visible (a consumer that joins
        # before gets an empty assignment), and insist on co-partitioning: one group, one replica.
        chunk_parts, event_parts = self.weights.partitions(topics.chunks), self.weights.partitions(topics.events)
        if len(chunk_parts) != len(event_parts):
            raise RuntimeError(
                f"{topics.chunks!r} has {len(chunk_parts)} partitions and {topics.events!r} {len(event_parts)}: "
                "they must match, so that every record of a group reaches the same replica"
            )
        self.consumer = self._join()
        self.http = StatusServer(s.metrics_host, s.metrics_port, self.metrics.registry, self._healthy).start()
        try:
            self.weights.catch_up(s.kafka.request_timeout_ms / 1000)
            self._publish_outbox()  # leftovers of a replica that crashed
            _log.info(
                "collector_started",
                replica=self.replica,
                metrics_port=self.http.port,
                keep_versions=s.keep_versions,
                batch_groups=s.batch_groups,
                no_signal_groups=s.no_signal_groups.value,
                stale_groups=s.stale_groups.value,
                group_id=s.consumer_group,
            )
            self.ready.set()
            self._loop()
        finally:
            self.consumer.close()
            self.weights.close()
            self.producer.close()
            self.http.stop()
            redis_client.close()

    def _check_decided_ttl(self) -> None:
        """Refuse a ``decided`` TTL that Kafka's retention of the input topics could outlive (see
        ``shared.topology``): a mark forgotten while its group's records can still be read again
        would let that group be decided, and trained, twice."""
        s = self.settings
        if not s.decided_ttl_s:
            return
        configs = topic_configs(s.kafka, [s.topics.chunks, s.topics.events])
        bounds = {name: TopicSpec(0, config).deleted_within_ms() for name, config in configs.items()}
        too_long = {n: b for n, b in bounds.items() if b is None or b >= s.decided_ttl_s * 1000}
        if too_long:
            shown = {n: "forever" if b is None else f"{b / 3_600_000:g} h" for n, b in too_long.items()}
            raise RuntimeError(
                f"REIN_DECIDED_TTL_S ({s.decided_ttl_s:g} s) does not outlive the retention of {shown} "
                "(retention.ms + segment.ms): raise it, shorten the topics' retention, or set it to 0 (never trim)"
            )

    def _join(self) -> Consumer:
        """A consumer-group member on chunks + events, joined only once their metadata is visible."""
        s = self.settings
        topics = s.topics
        consumer = Consumer(
            s.kafka, (), s.consumer_group, on_decode_error=self._bad_record, on_revoked=self._revoked,
            on_assigned=self._assigned, client_suffix=f"collector-{self.replica}",
        )
        for topic in (topics.chunks, topics.events):  # a member that joins without metadata gets nothing
            deadline = time.monotonic() + s.kafka.request_timeout_ms / 1000
            while not consumer.raw.partitions_for_topic(topic):
                if time.monotonic() > deadline:
                    consumer.close()
                    raise RuntimeError(f"topic {topic!r} metadata did not arrive")
        consumer.subscribe([topics.chunks, topics.events])
        return consumer

    def _healthy(self) -> tuple[bool, dict[str, object]]:
        stalled = time.monotonic() - self.last_loop >= max(30.0, 10 * self.settings.poll_timeout_s)
        ok = self.ready.is_set() and not stalled
        return ok, {"ok": ok, "status": "ok" if ok else ("stalled" if stalled else "starting"), "replica": self.replica}

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        s = self.settings
        next_drain = next_lag = next_registry_check = next_trim = time.monotonic()
        outage: Outage | None = None
        while not self.stop.is_set():
            self.last_loop = now = time.monotonic()
            try:
                self.weights.poll(0.0)
                if now >= next_registry_check:
                    self.weights.repair()
                    next_registry_check = now + s.registry_check_s
                if s.decided_ttl_s and now >= next_trim:
                    self.metrics.decided_trimmed.inc(self.store.trim_decided(s.decided_ttl_s))
                    next_trim = now + 60.0
                # Records polled but not folded yet (Redis failed under _fold) are folded again before
                # polling on; groups completed but not handled yet are handled again (steps are
                # idempotent per group id). Nothing read is dropped during an outage.
                if not self._unfolded:
                    self._unfolded = self._poll()
                self._backlog.extend(self._fold(self._unfolded, now))
                self._unfolded = []
                if self._backlog:
                    self._handle(self._backlog)
                    self._backlog = []
                    next_drain = now + s.drain_interval_s
                elif now >= next_drain:
                    self._publish_outbox()
                    next_drain = now + s.drain_interval_s
            except _LOOP_ERRORS as exc:
                outage = outage or Outage(_log, self.metrics.outages)
                self.stop.wait(outage.failed(exc))
                continue
            if outage is not None:
                outage.recovered()
                outage = None
                self.assembler.touch(now)  # records held up by the outage must not count as silence
            expired = self.assembler.expire(now, s.incomplete_timeout_s)
            for group in expired.failed:  # decided (and retried) with the next iteration's groups
                self.metrics.abandoned.labels(outcome="failed").inc()
                _log.warning("group_incomplete", group_id=group.group_id, prompt_id=group.prompt_id,
                             timeout_s=s.incomplete_timeout_s)
            self._backlog.extend(expired.failed)
            for gid in expired.dropped:
                self.metrics.abandoned.labels(outcome="dropped").inc()
                _log.warning("group_abandoned", group_id=gid, timeout_s=s.incomplete_timeout_s,
                             note="no GroupDispatched record: the group cannot be built")
            self._commit()
            self.metrics.assembling.set(self.assembler.assembling)
            if now >= next_lag:
                self._measure_lag()
                next_lag = now + s.lag_interval_s

    def _poll(self) -> list[Polled]:
        return self.consumer.poll(self.settings.poll_timeout_s)

    def _bad_record(self, topic: str, partition: int, offset: int, exc: DecodeError) -> None:
        self.metrics.decode_errors.inc(topic, exc.reason)

    def _fold(self, polled: list[Polled], now: float) -> list[CompletedGroup]:
        fresh = sorted(
            {gid for p in polled if (gid := getattr(p.record, "group_id", None)) and not self.assembler.knows(gid)}
        )
        done = self.store.decided(fresh)
        if done:  # read from the primary: its offsets are committed only once the replicas hold the decision
            self.store.replication.wait(self.store.client, self.store.keys)
        for gid in done:
            self.assembler.mark_done(gid)
        completed = []
        for p in polled:
            group = self.assembler.add(Position(p.topic, p.partition, p.offset), p.record, now)
            if group is not None:
                completed.append(group)
        return completed

    def _handle(self, completed: list[CompletedGroup]) -> None:
        done = self.store.decided([g.group_id for g in completed])
        if done:  # as in _fold: released (and committed) only once the replicas hold the decision
            self.store.replication.wait(self.store.client, self.store.keys)
        todo = [g for g in completed if g.group_id not in done]
        futures = [self.producer.send_async(self.settings.topics.groups, g) for g in todo]
        refs = [self.producer.wait(f) for f in futures]
        views = [window_group(g) for g in todo]
        self._ensure_registered(sorted({v for view in views for v in view.versions}))
        for group, view, ref in zip(todo, views, refs, strict=True):
            outcome = self.store.step(
                view, GroupRef(group_id=group.group_id, partition=ref.partition, offset=ref.offset), group.prompt
            )
            self.metrics.groups.labels(status="failed" if group.failed else "ok").inc()
            self.report.outcome(outcome)
            if outcome.result is not None:
                self.report.staleness(group)
                if not view.failed:
                    self.report.signal(view, outcome.result)
        self._publish_outbox()
        for group in completed:
            self.assembler.release(group.group_id)

    def _ensure_registered(self, labels: list[str]) -> None:
        """A label not in the registry yet may be in ``weights`` already: read it to the end once per label."""
        unknown = [
            label
            for label, known in zip(labels, self.store.registered(labels), strict=True)
            if not known and label not in self._caught_up_for
        ]
        if unknown:
            self.weights.catch_up(self.settings.kafka.request_timeout_ms / 1000)
            self._caught_up_for.update(unknown)

    def _publish_outbox(self) -> None:
        before = self.store.conflicts
        n = self.store.outbox.drain(self._send, timeout_s=max(30.0, 3 * self.settings.outbox_lock_ms / 1000))
        if n:
            self.metrics.published.inc(n)
        self.metrics.conflicts.inc(self.store.conflicts - before)

    def _send(self, items: list[tuple[str, Record]]) -> list[Delivered]:
        # Bounded to half the outbox lease: a publish ends (acked, or failed and retried later)
        # before the lease could pass to another replica, which would publish the same entries again.
        return self.producer.send_many(items, timeout_s=self.settings.outbox_lock_ms / 2000)

    def _commit(self) -> None:
        for pos in self.assembler.take_done():
            self.consumer.done(pos.topic, pos.partition, pos.offset)
        if not self.consumer.commit():  # the group rebalanced: the new owner re-reads from the last commit
            self.metrics.commit_errors.inc()

    def _revoked(self, tps: set[tuple[str, int]]) -> None:
        """Partitions left this replica (every one, with the eager protocol): drop their unreleased groups."""
        gone = self.assembler.forget_partitions(tps)
        if gone:
            _log.info("groups_forgotten", groups=len(gone), note="rebuilt by the partitions' next owner")

    def _assigned(self, tps: set[tuple[str, int]]) -> None:
        """Partitions came to this replica: they are read from their committed offsets, groups rebuilt."""
        topics = self.settings.topics
        chunk_parts = sorted(p for t, p in tps if t == topics.chunks)
        event_parts = sorted(p for t, p in tps if t == topics.events)
        if chunk_parts != event_parts:  # the Range assignor keeps them together; anything else splits groups
            raise RuntimeError(
                f"{topics.chunks!r} partitions {chunk_parts} and {topics.events!r} partitions {event_parts} were "
                "assigned apart: every record of a group must reach the same replica (Range assignor, equal counts)"
            )

    def _measure_lag(self) -> None:
        raw = self.consumer.raw
        assigned = list(raw.assignment())
        if not assigned:
            return
        try:
            end = raw.end_offsets(assigned)
        except KafkaError:
            return
        for tp in assigned:
            self.metrics.lag.labels(topic=tp.topic, partition=str(tp.partition)).set(max(0, end[tp] - raw.position(tp)))
