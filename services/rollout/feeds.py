"""What the rollout runner reads from Kafka: retries, and weights (sync mode, or async with pacing).

:class:`KafkaFeed` runs one kafka-python consumer on its own thread and hands records to
the event loop. :class:`Feeds` starts the runner's feeds, waits until each has read the
history that existed when it got its partitions (so queued retries are known before the
first dispatch), and turns records into :class:`~services.rollout.scheduler.Scheduler`
events: a ``RetryRequest`` becomes queued work, a revoke drops the queued work of the
lost partitions, a ``WeightApplied`` or ``BatchSkipped`` may open the next sync wave and moves the
:class:`~services.rollout.pacing.Pacer`'s count of batches the trainer consumed. A
retry record's offset is committed once :meth:`Feeds.done` says its group is dispatched
(or it needs none).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from services.rollout.observe import RolloutMetrics
from services.rollout.pacing import Pacer
from services.rollout.scheduler import RetrySource, Scheduler, retry_work
from services.rollout.settings import RolloutSettings
from services.rollout.task import Task
from shared import log
from shared.bus import BusUnavailable, Consumer, Polled
from shared.codec import DecodeError
from shared.schemas import BatchSkipped, RetryRequest, WeightApplied
from shared.settings import KafkaSettings

_log = log.get(__name__)


class KafkaFeed:
    """One Kafka consumer on its own thread (kafka-python clients are not thread-safe).

    Records go to ``deliver`` on the event loop, and rebalances to ``on_revoked`` through
    the same FIFO, so a revoke is handled before any record of the next assignment.
    Positions the loop marks done are applied, and committed, on the consumer's thread.
    ``ready`` is set once the consumer has read every record that existed when it got its
    partitions (so history is known before dispatch).
    """

    def __init__(
        self,
        name: str,
        kafka: KafkaSettings,
        topics: list[str],
        group_id: str | None,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[Polled], None],
        on_error: Callable[[BaseException], None],
        on_decode_error: Callable[[str, int, int, DecodeError], None],
        on_revoked: Callable[[set[tuple[str, int]]], None] | None = None,
    ) -> None:
        self.name = name
        self.ready = threading.Event()
        self._kafka, self._topics, self._group_id = kafka, topics, group_id
        self._loop, self._deliver, self._on_error, self._on_decode_error = loop, deliver, on_error, on_decode_error
        self._on_revoked = on_revoked
        self._stop = threading.Event()
        self._done: list[RetrySource] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"feed-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def done(self, sources: list[RetrySource]) -> None:
        """These records' work is durable; applied and committed on the consumer's thread."""
        with self._lock:
            self._done.extend(sources)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _call_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already closed: the runner is gone
            self._loop.call_soon_threadsafe(fn, *args)

    def _flush_commits(self, consumer: Consumer) -> None:
        with self._lock:
            done, self._done = self._done, []
        for source in done:
            consumer.done(source.topic, source.partition, source.offset)
        if self._group_id is not None:
            consumer.commit()

    def _revoked(self, tps: set[tuple[str, int]]) -> None:
        if self._on_revoked is not None:
            self._call_loop(self._on_revoked, tps)

    def _run(self) -> None:
        consumer: Consumer | None = None
        try:
            consumer = Consumer(
                self._kafka, self._topics, self._group_id, client_suffix=f"rollout-{self.name}",
                on_decode_error=lambda *a: self._call_loop(self._on_decode_error, *a),
                on_revoked=self._revoked,
            )
            targets: dict[Any, int] = {}
            next_report = time.monotonic() + 5.0
            while not self._stop.is_set():
                for polled in consumer.poll(0.2):
                    self._call_loop(self._deliver, polled)
                self._flush_commits(consumer)
                if not self.ready.is_set():
                    assignment = consumer.raw.assignment()
                    missing = [tp for tp in assignment if tp not in targets]
                    if missing:
                        targets.update(consumer.raw.end_offsets(missing))
                    if assignment and all(consumer.raw.position(tp) >= targets[tp] for tp in assignment):
                        self.ready.set()
                    elif time.monotonic() > next_report:
                        next_report = time.monotonic() + 5.0
                        _log.warning("feed_catching_up", feed=self.name, assigned=len(assignment),
                                     lag={f"{tp.topic}/{tp.partition}": targets[tp] - consumer.raw.position(tp)
                                          for tp in assignment})
            self._flush_commits(consumer)
        except BaseException as exc:  # a dead feed must stop the runner loudly (STYLE 5)
            self._call_loop(self._on_error, exc)
        finally:
            if consumer is not None:
                consumer.close()


class Feeds:
    """The runner's retry feed (consumer group) and its weights feed (no group; sync mode or pacing)."""

    def __init__(
        self,
        settings: RolloutSettings,
        task: Task,
        scheduler: Scheduler,
        pacer: Pacer,
        metrics: RolloutMetrics,
        logger: structlog.stdlib.BoundLogger,
        wake: Callable[[], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.settings, self.task, self.scheduler, self.metrics, self.log = settings, task, scheduler, metrics, logger
        self.pacer = pacer
        self._wake, self._on_error = wake, on_error
        self._error: BaseException | None = None
        self._feeds: list[KafkaFeed] = []
        self._retry_feed: KafkaFeed | None = None

    async def start(self) -> None:
        """Start every feed and wait (bounded) until each has caught up; raises a feed's error."""
        s, loop = self.settings, asyncio.get_running_loop()
        self._retry_feed = KafkaFeed("retries", s.kafka, [s.topics.retries], s.retry_consumer_group, loop,
                                     self._on_retry, self._failed, self._decode_error, self._on_retries_revoked)
        self._feeds.append(self._retry_feed)
        if s.mode == "sync" or self.pacer.enabled:
            self._feeds.append(KafkaFeed("weights", s.kafka, [s.topics.weights], None, loop,
                                         self._on_weights, self._failed, self._decode_error))
        for feed in self._feeds:
            feed.start()
        for feed in self._feeds:
            caught_up = await asyncio.to_thread(feed.ready.wait, s.startup_timeout_s)
            if self._error is not None:
                raise self._error
            if not caught_up:
                raise BusUnavailable(
                    f"Kafka consumer of {feed.name!r} did not catch up within {s.startup_timeout_s}s "
                    f"(bootstrap {s.kafka.bootstrap_servers})"
                )

    async def stop(self) -> None:
        for feed in self._feeds:
            await asyncio.to_thread(feed.stop)

    def done(self, sources: list[RetrySource]) -> None:
        """These retry records' work is durable: their offsets may be committed."""
        if sources and self._retry_feed is not None:
            self._retry_feed.done(sources)

    # ------------------------------------------------------------------ on the loop

    def _failed(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._on_error(exc)

    def _decode_error(self, topic: str, _partition: int, _offset: int, exc: DecodeError) -> None:
        self.metrics.decode_errors.inc(topic, exc.reason)

    def _on_retry(self, polled: Polled) -> None:
        record = polled.record
        source = RetrySource(polled.topic, polled.partition, polled.offset)
        if not isinstance(record, RetryRequest) or not self._playable(record.prompt):
            self.log.error("retry_skipped", type=record.type, offset=polled.offset)
            self.metrics.bad_retries.inc()
            self.done([source])
            return
        work = retry_work(record.prompt_id, record.attempt, dict(record.prompt), source, record.free_retries)
        outcome = self.scheduler.add_retry(work)
        if outcome != "queued":
            self.log.info("retry_duplicate", prompt_id=record.prompt_id, attempt=record.attempt, outcome=outcome)
            self.metrics.duplicate_retries.inc()
        if outcome == "dispatched":
            self.done([source])
        self._wake()

    def _on_retries_revoked(self, tps: set[tuple[str, int]]) -> None:
        dropped = self.scheduler.revoke(tps)
        self.log.info("retries_revoked", partitions=sorted(f"{t}/{p}" for t, p in tps), queued_dropped=dropped)

    def _playable(self, payload: dict[str, Any]) -> bool:
        try:
            self.task.episode().reset(dict(payload))
        except ValueError:
            return False
        return True

    def _on_weights(self, polled: Polled) -> None:
        record = polled.record
        if isinstance(record, WeightApplied):
            self.scheduler.on_weights_applied(record.seq)
            # An older trainer's record has no last_index: its step count is a lower bound (skips not counted).
            self.pacer.on_consumed(record.last_index if record.last_index is not None else record.seq - 1)
            self.metrics.weights_seq.set(self.scheduler.weights_seq)
            self._wake()
        elif isinstance(record, BatchSkipped):
            self.scheduler.on_batch_skipped(record.index)
            self.pacer.on_consumed(record.index)
            self._wake()
