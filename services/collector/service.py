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

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kafka import TopicPartition
from kafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from services.collector.assembly import (
    Assembler,
    Position,
    RecentSpans,
    SeenOnce,
    partial_rollout_rejected_samples,
    version_spans,
)
from services.collector.settings import CollectorSettings
from services.collector.window_store import StepOutcome, WindowStore
from shared import log
from shared.bus import Consumer, Delivered, Polled, Producer, ensure_topology, topic_configs
from shared.metrics import DecodeErrors, counter, gauge, render
from shared.names import RedisKeys
from shared.outage import DEPENDENCY_ERRORS, Outage
from shared.replay import window_group
from shared.schemas import CompletedGroup, DecodeError, GroupRef, Record, WeightApplied, WeightPublished
from shared.staleness import Decision, WindowConfig
from shared.state import RedisRegistry, connect
from shared.topology import TopicSpec

_log = log.get(__name__)

_LOOP_ERRORS: tuple[type[BaseException], ...] = (*DEPENDENCY_ERRORS, TimeoutError)
"""What one loop iteration waits out and redoes (TimeoutError: the weights catch-up, the outbox lease)."""


_SPAN_DOC = (
    "Version span {} (distinct real versions per trajectory) over the last trajectories of completed, "
    "non-failed groups on this replica"
)


class CollectorMetrics:
    """Everything ``/metrics`` shows; one registry per collector (no process globals)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decode_errors = DecodeErrors(r)
        self.groups = counter(r, "collector/groups", "Completed groups handled (rate = groups/s)", ("status",))
        self.decisions = counter(r, "staleness/decisions", "Window decisions made by this replica", ("decision",))
        self.dropped = counter(r, "staleness/dropped_groups", "Groups dropped by this replica, by reason", ("reason",))
        self.batches = counter(r, "collector/batches", "Batch manifests emitted by this replica's steps")
        self.published = counter(r, "collector/outbox_published", "Outbox records published by this replica")
        self.conflicts = counter(r, "collector/window_conflicts", "Window steps retried after another replica's")
        self.abandoned = counter(
            r, "collector/abandoned_groups",
            "Groups with no record for the incomplete timeout: failed (decided, retried) or dropped (never dispatched)",
            ("outcome",),
        )
        self.weight_errors = counter(r, "collector/weight_errors", "Weight records the registry refused")
        self.decided_trimmed = counter(
            r, "collector/decided_trimmed", "Decided marks forgotten after REIN_DECIDED_TTL_S"
        )
        self.commit_errors = counter(r, "collector/commit_errors", "Offset commits refused (rebalance)")
        self.outages = counter(
            r, "collector/dependency_errors", "Loop iterations that failed on Redis or Kafka and were retried",
            ("what",),
        )
        self.registry_rebuilds = counter(
            r, "collector/registry_rebuilds", "Times the Redis version registry was found short and rebuilt"
        )
        self.current_index = gauge(
            r, "staleness/current_version_index", "Registry index of the window's newest version"
        )
        self.cutoff_index = gauge(r, "staleness/cutoff_version_index", "Lowest registry index still inside the window")
        self.gap_min = gauge(r, "staleness/version_gap_min", "Version gap min of the last manifest")
        self.gap_max = gauge(r, "staleness/version_gap_max", "Version gap max of the last manifest")
        self.gap_mean = gauge(r, "staleness/version_gap_mean", "Version gap mean of the last manifest")
        self.span_min = gauge(r, "staleness/version_span_min", _SPAN_DOC.format("min"))
        self.span_max = gauge(r, "staleness/version_span_max", _SPAN_DOC.format("max"))
        self.span_mean = gauge(r, "staleness/version_span_mean", _SPAN_DOC.format("mean"))
        self.partial_rejected_groups = counter(
            r,
            "staleness/partial_rollout_rejected_groups",
            "Failed group attempts with a session rejected for partial_rollout_staleness_exceeded",
        )
        self.partial_rejected_samples = counter(
            r,
            "staleness/partial_rollout_rejected_samples",
            "Trajectories of the group attempts counted in partial_rollout_rejected_groups",
        )
        self.partial_rejected_prompts = counter(
            r,
            "staleness/partial_rollout_rejected_prompts",
            "Distinct prompts (seen by this replica) with a group rejected for partial_rollout_staleness_exceeded",
        )
        self.assembling = gauge(r, "collector/assembling_groups", "Groups seen but not complete on this replica")
        self.lag = gauge(r, "collector/consumer_lag", "Records behind the partition end", ("topic", "partition"))


class HealthServer:
    """``/metrics`` and ``/health`` on a small threaded HTTP server."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, healthy: Callable[[], bool]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype = render(registry)
                    self._reply(200, body, ctype)
                elif path == "/health":
                    ok = healthy()
                    self._reply(200 if ok else 503, json.dumps({"ok": ok}).encode(), "application/json")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="collector-http", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class WeightsFollower:
    """Reads ``weights`` from the beginning (no consumer group) into the Redis registry."""

    def __init__(self, settings: CollectorSettings, registry: RedisRegistry, metrics: CollectorMetrics) -> None:
        self.topic = settings.topics.weights
        self.registry = registry
        self.metrics = metrics
        self.consumer = Consumer(settings.kafka, (), None, on_decode_error=self._bad, client_suffix="collector-weights")
        self.known: dict[str, int] = {}
        """label -> sequence of every weight record read (the first one of a label wins, as in Redis)."""
        self._unpublished: dict[str, int] = {}
        self._refused: set[str] = set()
        self.timeout_s = settings.kafka.request_timeout_ms / 1000
        raw = self.consumer.raw
        self.tps = [TopicPartition(self.topic, p) for p in self.partitions(self.topic)]
        raw.assign(self.tps)
        raw.seek_to_beginning(*self.tps)

    def partitions(self, topic: str) -> list[int]:
        """Partition ids of ``topic`` once the broker's metadata lists them (bounded wait)."""
        raw = self.consumer.raw
        deadline = time.monotonic() + self.timeout_s
        parts = raw.partitions_for_topic(topic)
        while not parts:
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic!r} has no partitions (metadata did not arrive)")
            raw.cluster.request_update()
            raw.poll(timeout_ms=100)  # drives the metadata request
            parts = raw.partitions_for_topic(topic)
        return sorted(parts)

    def _bad(self, topic: str, partition: int, offset: int, exc: DecodeError) -> None:
        self.metrics.decode_errors.inc(topic, exc.reason)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Fold new weight records into Redis. Each is remembered first, so a Redis error here loses
        nothing: the unpublished ones are published on the next call, and :meth:`repair` restores
        whatever Redis lost."""
        n = 0
        for polled in self.consumer.poll(timeout_s):
            record = polled.record
            if isinstance(record, WeightPublished | WeightApplied) and record.version not in self.known:
                self.known[record.version] = record.seq
                self._unpublished[record.version] = record.seq
                n += 1
        self._publish_unpublished()
        return n

    def repair(self) -> None:
        """Rebuild the registry from the records read so far when Redis holds fewer than were read
        (Redis restarted empty, or its keys were deleted): one ZCARD when nothing is missing."""
        in_redis = self.registry.count()
        if in_redis < len(self.known) - len(self._refused):
            _log.warning("registry_rebuilt", known=len(self.known), in_redis=in_redis)
            self.metrics.registry_rebuilds.inc()
            self._unpublished = {k: v for k, v in self.known.items() if k not in self._refused}
            self._publish_unpublished()

    def _publish_unpublished(self) -> None:
        for label, seq in sorted(self._unpublished.items(), key=lambda kv: kv[1]):
            try:
                self.registry.publish(label, seq)
            except ValueError as exc:
                self._refused.add(label)
                self.metrics.weight_errors.inc()
                _log.error("weight_refused", version=label, seq=seq, error=str(exc))
            del self._unpublished[label]

    def catch_up(self, timeout_s: float) -> None:
        """Read until every partition's position reaches the end offset seen now (bounded)."""
        raw = self.consumer.raw
        end = raw.end_offsets(self.tps)
        deadline = time.monotonic() + timeout_s
        while any(raw.position(tp) < end[tp] for tp in self.tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.topic!r} to its end within {timeout_s}s")
            self.poll(0.1)

    def close(self) -> None:
        self.consumer.close()


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Collector:
    """One replica. ``run(stop)`` loops until ``stop`` is set; every component is built here and passed down."""

    def __init__(self, settings: CollectorSettings, stop: threading.Event | None = None) -> None:
        self.settings = settings
        self.stop = stop or threading.Event()
        self.replica = settings.replica_id or default_replica_id()
        self.metrics = CollectorMetrics()
        self.config = WindowConfig(
            settings.keep_versions, settings.batch_groups, settings.max_retries, settings.max_free_retries
        )
        self.assembler = Assembler()
        self.spans = RecentSpans()
        self.rejected_prompts = SeenOnce()
        self.last_loop = time.monotonic()
        self.ready = threading.Event()
        self.http: HealthServer | None = None
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
        self.http = HealthServer(s.metrics_host, s.metrics_port, self.metrics.registry, self._healthy)
        self.http.start()
        try:
            self.weights.catch_up(s.kafka.request_timeout_ms / 1000)
            self._publish_outbox()  # leftovers of a replica that crashed
            _log.info(
                "collector_started",
                replica=self.replica,
                metrics_port=self.http.port,
                keep_versions=s.keep_versions,
                batch_groups=s.batch_groups,
                group_id=s.group_id,
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
            s.kafka, (), s.group_id, on_decode_error=self._bad_record, on_revoked=self._revoked,
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

    def _healthy(self) -> bool:
        return self.ready.is_set() and time.monotonic() - self.last_loop < max(30.0, 10 * self.settings.poll_timeout_s)

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
        for gid in self.store.decided(fresh):
            self.assembler.mark_done(gid)
        completed = []
        for p in polled:
            group = self.assembler.add(Position(p.topic, p.partition, p.offset), p.record, now)
            if group is not None:
                completed.append(group)
        return completed

    def _handle(self, completed: list[CompletedGroup]) -> None:
        done = self.store.decided([g.group_id for g in completed])
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
            self._count(outcome)
            if outcome.result is not None:
                self._count_staleness(group)
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

    def _count(self, outcome: StepOutcome) -> None:
        if outcome.result is None:
            return
        for d in outcome.result.decisions:
            self.metrics.decisions.labels(decision=d.decision.value).inc()
            if d.decision is not Decision.KEPT and d.decision is not Decision.FAILED_RETRY:
                self.metrics.dropped.labels(reason=d.decision.value).inc()
            log_fn = _log.info if d.decision is Decision.KEPT else _log.warning
            log_fn(
                "group_decided",
                group_id=d.group_id,
                prompt_id=d.prompt_id,
                attempt=d.attempt,
                decision=d.decision.value,
                versions=list(d.versions),
                current=d.window.current_version,
                cutoff_index=d.window.cutoff_index,
                step=outcome.step,
            )
        snap = outcome.result.decisions[-1].window
        if snap.current_index is not None:
            self.metrics.current_index.set(snap.current_index)
        if snap.cutoff_index is not None:
            self.metrics.cutoff_index.set(snap.cutoff_index)
        batch = outcome.result.batch
        if batch is not None:
            self.metrics.batches.inc()
            if batch.gap is not None:
                self.metrics.gap_min.set(batch.gap.min)
                self.metrics.gap_max.set(batch.gap.max)
                self.metrics.gap_mean.set(batch.gap.mean)
            _log.info("batch_taken", index=batch.index, groups=len(batch.groups), drops=len(batch.dropped))

    def _count_staleness(self, group: CompletedGroup) -> None:
        """Span gauges and partial-rollout rejection counters of one newly decided group."""
        self.spans.add(version_spans(group))
        stats = self.spans.stats()
        if stats is not None:
            self.metrics.span_min.set(stats.min)
            self.metrics.span_max.set(stats.max)
            self.metrics.span_mean.set(stats.mean)
        samples = partial_rollout_rejected_samples(group)
        if samples:
            self.metrics.partial_rejected_groups.inc()
            self.metrics.partial_rejected_samples.inc(samples)
            if self.rejected_prompts.add(group.prompt_id):
                self.metrics.partial_rejected_prompts.inc()

    def _publish_outbox(self) -> None:
        before = self.store.conflicts
        n = self.store.drain(self._send, timeout_s=max(30.0, 3 * self.settings.outbox_lock_ms / 1000))
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
        _log.info("partitions_revoked", revoked=sorted(f"{t}/{p}" for t, p in tps), groups_dropped=len(gone))

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
