"""The bus's producer: idempotent, acks=all, bounded waits for the broker's ack.

It replaces its kafka-python client after a delivery expired. kafka-python 2.3's idempotent sender
can stop sending to a partition for good after a broker outage: when a batch it had already sent
expires, it resets its producer id and returns without sending the batches it had just drained, and
their partitions stay muted (one request in flight per partition), so every later record to them
expires too, while the broker answers and other partitions work. A new client has no such state;
records the old one still holds are delivered or fail within their delivery timeout (those it will never
send are failed then), and their callers hear either way; then it is closed. (Reproduced, and tested,
by killing the broker under load: ``tests/integration/shared/test_producer_recovery.py``.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from kafka import KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError

from shared import log
from shared.bus.client import BusUnavailable, Delivered, connect, servers
from shared.codec import DEFAULT_MAX_BYTES, encode
from shared.schemas import Record
from shared.settings import KafkaSettings

_log = log.get(__name__)

REBUILD_RETRY_S = 5.0
"""After a failed rebuild (broker still down), the old client serves this long before the next try."""


class Producer:
    """Idempotent producer (acks=all); ``send`` returns once the broker has the record."""

    def __init__(self, settings: KafkaSettings, client_suffix: str = "producer") -> None:
        self._settings = settings
        self._client_id = f"{settings.client_id}-{client_suffix}"
        self._timeout_s = settings.request_timeout_ms / 1000
        # every record is answered (acked or failed) within one request bound after its linger
        self._delivery_timeout_ms = settings.linger_ms + settings.request_timeout_ms
        self._expired = threading.Event()
        """Set by a delivery that expired: the next send replaces the client (see the module's docstring)."""
        self._rebuild_lock = threading.Lock()
        self._next_rebuild = 0.0
        self.replacements = 0
        """Clients replaced since start."""
        self._producer: KafkaProducer = self._build(attempts=5)

    def _build(self, attempts: int) -> KafkaProducer:
        settings = self._settings
        producer: KafkaProducer = connect(
            lambda: KafkaProducer(
                bootstrap_servers=servers(settings),
                client_id=self._client_id,
                acks="all",
                enable_idempotence=True,
                linger_ms=settings.linger_ms,
                request_timeout_ms=settings.request_timeout_ms,
                delivery_timeout_ms=self._delivery_timeout_ms,
                max_block_ms=settings.max_block_ms,
                max_request_size=min(settings.max_record_bytes, DEFAULT_MAX_BYTES),
            ),
            "producer",
            settings,
            attempts=attempts,
        )
        return producer

    def _client(self) -> KafkaProducer:
        """The client to send with: a new one when a delivery has expired since the last build."""
        if self._expired.is_set() and time.monotonic() >= self._next_rebuild:
            with self._rebuild_lock:
                if self._expired.is_set() and time.monotonic() >= self._next_rebuild:
                    self._replace()
        return self._producer

    def _replace(self) -> None:
        try:
            fresh = self._build(attempts=1)
        except (BusUnavailable, KafkaError) as exc:
            self._next_rebuild = time.monotonic() + REBUILD_RETRY_S
            _log.warning("kafka_producer_not_replaced", client_id=self._client_id, error=str(exc),
                         retry_in_s=REBUILD_RETRY_S)
            return
        old, self._producer = self._producer, fresh
        self._expired.clear()
        self.replacements += 1
        _log.warning("kafka_producer_replaced", client_id=self._client_id, replacements=self.replacements,
                     reason="a delivery expired")
        # the old client answers what it holds within its delivery timeout, then closes
        threading.Thread(target=_retire, args=(old, self._delivery_timeout_ms / 1000 + 1.0),
                         name="producer-retire", daemon=True).start()

    def _note(self, exc: BaseException) -> None:
        """Errback on every record: an expired delivery marks the client for replacement."""
        if isinstance(exc, KafkaTimeoutError):
            self._expired.set()

    def send(self, topic: str, record: Record, key: str | None = None) -> Delivered:
        """Produce one record and wait for the broker's ack (bounded by request_timeout_ms)."""
        future = self.send_async(topic, record, key)
        return self.wait(future)

    def send_async(self, topic: str, record: Record, key: str | None = None) -> object:
        """Queue one record; pair with :meth:`wait` or :meth:`flush`."""
        # keys are encoded here: kafka-python 3 deprecates plain callables as serializers
        text = key if key is not None else record.key()
        future = self._client().send(topic, value=encode(record), key=text.encode("utf-8"))
        future.add_errback(self._note)
        return future

    def send_encoded(self, topic: str, value: bytes, key: str, done: Callable[[BaseException | None], None]) -> None:
        """Queue one encoded record; ``done(None)`` once acked, ``done(error)`` once it cannot be.

        ``done`` is called exactly once: from kafka-python's I/O thread, or from this call when
        the record could not even be queued (no metadata within max_block_ms, too large)."""
        try:
            future = self._client().send(topic, value=value, key=key.encode("utf-8"))
        except Exception as exc:  # a KafkaError, or an AssertionError of a closed producer
            done(exc)
            return
        future.add_callback(lambda _meta: done(None))
        future.add_errback(self._note)
        future.add_errback(done)

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

    def close(self) -> bool:
        """Flush and close within ``close_timeout_ms``; False when records were still unacked (dropped: the
        I/O thread is a daemon, the process can exit), so a stopping service never waits on a dead broker."""
        try:
            self._producer.close(timeout=self._settings.close_timeout_ms / 1000)
        except KafkaTimeoutError:
            return False
        return True


def _retire(producer: KafkaProducer, timeout_s: float) -> None:
    """Close a replaced client, letting it answer what it holds within ``timeout_s`` first.

    kafka-python's ``close()`` flushes first and, when a batch never completes (the drained, never-sent
    batches the replacement works around), raises before it stops its I/O thread, which then outlives the
    client and raises again when the client is collected. Those batches are failed instead (each record's
    callback hears it) and the client is closed without waiting."""
    try:
        producer.close(timeout=timeout_s)
        return
    except KafkaError as exc:
        failed = _fail_unfinished(producer)
        _log.warning("retired_kafka_producer_forced", error=str(exc), failed_batches=failed)
    producer.close(timeout=0)


def _fail_unfinished(producer: KafkaProducer) -> int:
    """Fail every batch the client still counts as unfinished; how many. kafka-python has no public call for
    it, so this reads its accumulator (2.3's ``_incomplete`` and ``deallocate``)."""
    accumulator = producer._accumulator
    batches = accumulator._incomplete.all()
    for batch in batches:
        if not batch.is_done:  # not a KafkaTimeoutError: the current client is not to be replaced for it
            batch.abort(KafkaError("the replaced Kafka producer never sent this record"))
        accumulator.deallocate(batch)
    return len(batches)
