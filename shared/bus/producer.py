"""The bus's producer: idempotent, acks=all, bounded waits for the broker's ack."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kafka import KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError

from shared.bus.client import BusUnavailable, Delivered, connect, servers
from shared.codec import DEFAULT_MAX_BYTES, encode
from shared.schemas import Record
from shared.settings import KafkaSettings


class Producer:
    """Idempotent producer (acks=all); ``send`` returns once the broker has the record."""

    def __init__(self, settings: KafkaSettings, client_suffix: str = "producer") -> None:
        self._settings = settings
        self._timeout_s = settings.request_timeout_ms / 1000
        self._producer: KafkaProducer = connect(
            lambda: KafkaProducer(
                bootstrap_servers=servers(settings),
                client_id=f"{settings.client_id}-{client_suffix}",
                acks="all",
                enable_idempotence=True,
                linger_ms=settings.linger_ms,
                request_timeout_ms=settings.request_timeout_ms,
                # every record is answered (acked or failed) within one request bound after its linger
                delivery_timeout_ms=settings.linger_ms + settings.request_timeout_ms,
                max_block_ms=settings.max_block_ms,
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

    def send_encoded(self, topic: str, value: bytes, key: str, done: Callable[[BaseException | None], None]) -> None:
        """Queue one encoded record; ``done(None)`` once acked, ``done(error)`` once it cannot be.

        ``done`` is called exactly once: from kafka-python's I/O thread, or from this call when
        the record could not even be queued (no metadata within max_block_ms, too large)."""
        try:
            future = self._producer.send(topic, value=value, key=key.encode("utf-8"))
        except Exception as exc:  # a KafkaError, or an AssertionError of a closed producer
            done(exc)
            return
        future.add_callback(lambda _meta: done(None))
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
