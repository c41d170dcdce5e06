"""Kafka side of the proxy: records submitted in order, acks answered as asyncio futures.

:meth:`Publisher.submit` hands a record to one sender thread and returns at once with a
future that the broker's ack (or the failure) resolves; the caller decides when to await
it. The request path therefore never waits for the broker: a chat call submits its chunk
and goes on, and only ``finish`` (and a rejection) waits for the session's acks.

- **Order.** Every record goes through one FIFO: one sender thread calls kafka-python's
  ``send`` (which may block on metadata, bounded by ``max_block_ms``, never on the event
  loop) in submission order, and the idempotent producer keeps that order per partition.
  Records of one session share a key, hence a partition of each topic.
- **Cheap hops.** A submit is one ``SimpleQueue.put`` (no executor future per record), and
  acks come back in batches: the I/O thread queues each answer and wakes the loop only
  when its answer queue was empty, so a burst of acks costs one loop wake-up, not one each.
- **Bounded memory.** Bytes submitted and not yet answered are capped at
  ``max_inflight_bytes``: a submit waits (in arrival order) while the cap would be passed.
  A record larger than the cap still goes, alone. Gauges report bytes and records in flight.
- **Broker down at start.** The producer is built lazily (and rebuilt after a failed start),
  so a proxy started before its broker serves non-training sessions and answers training
  calls with 503 ``kafka_unavailable`` until the broker is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable

from kafka.errors import KafkaError

from services.proxy.metrics import ProxyMetrics
from shared import log
from shared.bus import BusUnavailable, Producer
from shared.codec import encode
from shared.errors import KafkaUnavailable
from shared.schemas import Chunk, Record
from shared.settings import KafkaSettings

_log = log.get(__name__)

Ack = asyncio.Future[None]
"""Resolved once the record is on Kafka; fails with :class:`KafkaUnavailable` when it cannot be."""
_Send = tuple[Producer, str, bytes, str, Callable[[BaseException | None], None]]
"""What the sender thread hands to kafka-python: producer, topic, value, key, answer callback."""
_Answer = tuple[Ack, str, Record, int, BaseException | None]
"""One answer for the loop: the ack, topic, record, its encoded size, the error (None: acked)."""


class Publisher:
    """One idempotent producer (acks=all) shared by every request of the app."""

    def __init__(self, settings: KafkaSettings, max_inflight_bytes: int, metrics: ProxyMetrics) -> None:
        self._settings = settings
        self._max_bytes = max_inflight_bytes
        self._metrics = metrics
        self._producer: Producer | None = None
        self._connect_lock = asyncio.Lock()
        self._room_lock = asyncio.Lock()
        """Held by the one submit waiting for room: the others queue behind it, in arrival order."""
        self._freed = asyncio.Event()
        self._outbox: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()
        """Records for the sender thread, in submission order; None tells it to stop."""
        self._sender = threading.Thread(target=self._send_all, args=(self._outbox,), name="proxy-publish",
                                        daemon=True)
        self._sending = False
        self._answers: list[_Answer] = []
        """Acks and failures from kafka-python's threads, waiting for the loop to take them."""
        self._answers_lock = threading.Lock()
        self.inflight_bytes = 0
        self.inflight_records = 0

    async def start(self) -> None:
        """Try to connect now; a failure is logged and retried on the first submit."""
        try:
            await self._connected()
        except KafkaUnavailable as exc:
            _log.warning("kafka_unavailable_at_start", error=str(exc))

    async def submit(self, topic: str, record: Record) -> Ack:
        """Queue ``record`` (keyed by its ``key()``) behind every record submitted before it.

        Returns once it is queued (after waiting for room under the in-flight cap); raises
        ``kafka_unavailable`` at once when no producer can be built."""
        producer = self._producer
        if producer is None:
            try:
                producer = await self._connected()
            except KafkaUnavailable:
                self._metrics.publish_failures.labels(record=record.type).inc()
                raise
        value = encode(record)
        size = len(value)
        if self._room_lock.locked() or not self._room_for(size):  # else nobody waits and it fits: no lock needed
            async with self._room_lock:
                while not self._room_for(size):
                    self._freed.clear()
                    await self._freed.wait()
        self._count(size, 1)
        loop = asyncio.get_running_loop()
        ack: Ack = loop.create_future()
        ack.add_done_callback(_retrieved)  # an ack nobody looks at any more (its session ended) is not an error

        def done(error: BaseException | None) -> None:  # on the sender or kafka-python's I/O thread
            with self._answers_lock:
                self._answers.append((ack, topic, record, size, error))
                first = len(self._answers) == 1
            if first:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(self._take_answers)

        if not self._sending:
            self._sending = True
            self._sender.start()
        self._outbox.put((producer, topic, value, record.key(), done))
        return ack

    async def send(self, topic: str, record: Record) -> None:
        """Submit ``record`` and wait for its ack; 503 ``kafka_unavailable`` on any broker failure."""
        await (await self.submit(topic, record))

    @staticmethod
    def _send_all(outbox: queue.SimpleQueue[_Send | None]) -> None:
        """The sender thread: hand each record to kafka-python in order until told to stop."""
        while (item := outbox.get()) is not None:
            producer, topic, value, key, done = item
            producer.send_encoded(topic, value, key, done)

    def _take_answers(self) -> None:
        with self._answers_lock:
            answers, self._answers = self._answers, []
        if not answers:
            return
        chunks = 0
        for ack, topic, record, size, error in answers:
            self.inflight_bytes -= size
            self.inflight_records -= 1
            if error is None:
                chunks += isinstance(record, Chunk)
                if not ack.done():
                    ack.set_result(None)
            else:
                self._failed(ack, topic, record, error)
        if chunks:
            self._metrics.chunks.inc(chunks)
        self._count(0, 0)
        self._freed.set()

    def _failed(self, ack: Ack, topic: str, record: Record, error: BaseException) -> None:
        self._metrics.publish_failures.labels(record=record.type).inc()
        if not ack.done():
            ack.set_exception(KafkaUnavailable(
                f"could not write a {record.type} record to Kafka topic {topic!r}: {type(error).__name__}: {error}",
                topic=topic,
            ))

    def _room_for(self, size: int) -> bool:
        return not self.inflight_records or self.inflight_bytes + size <= self._max_bytes

    def _count(self, size: int, records: int) -> None:
        self.inflight_bytes += size
        self.inflight_records += records
        self._metrics.inflight_bytes.set(self.inflight_bytes)
        self._metrics.inflight_records.set(self.inflight_records)

    async def _connected(self) -> Producer:
        async with self._connect_lock:
            if self._producer is None:
                try:
                    self._producer = await asyncio.to_thread(Producer, self._settings, "proxy")
                except (BusUnavailable, KafkaError) as exc:
                    raise KafkaUnavailable(
                        f"no Kafka broker at {self._settings.bootstrap_servers}: {exc}",
                        bootstrap_servers=self._settings.bootstrap_servers,
                    ) from exc
            return self._producer

    async def close(self) -> None:
        """Let the sender hand over what was submitted, then flush and close (bounded by the producer)."""
        if self._sending:
            self._outbox.put(None)
            await asyncio.to_thread(self._sender.join)
        if self._producer is not None:
            producer, self._producer = self._producer, None
            if not await asyncio.to_thread(producer.close):
                _log.warning("records_unacked_at_stop", note="Kafka did not take them within close_timeout_ms")


def _retrieved(ack: Ack) -> None:
    if not ack.cancelled():
        ack.exception()
