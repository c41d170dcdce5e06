"""The connection every Kafka client of the bus shares: brokers, bounded connect, result types."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kafka.client_async import KafkaClient
from kafka.errors import NoBrokersAvailable, UnrecognizedBrokerVersion

from shared import log
from shared.codec import DecodeError
from shared.offsets import TopicPartition as TP
from shared.schemas import Record
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
RebalanceHook = Callable[[set[TP]], None]


def servers(settings: KafkaSettings) -> list[str]:
    return [s.strip() for s in settings.bootstrap_servers.split(",") if s.strip()]


T = TypeVar("T")


def new_client(factory: Callable[[], T]) -> T:
    """Call a kafka-python client's constructor; where it raises, close the connections it opened first.

    A constructor that fails after connecting (``KafkaAdminClient`` whose broker accepted the connection but did
    not answer its API-versions probe in time: a busy broker, or a container's published port with the broker
    down) is never closed, and its client sits in reference cycles: the socket stays open until some later garbage
    collection finds it and warns, in whatever code runs then."""
    try:
        return factory()
    except BaseException as exc:
        _close_half_built(exc)
        raise


def _close_half_built(exc: BaseException) -> None:
    closed: set[int] = set()
    frame = exc.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        for client in (owner, getattr(owner, "_client", None)):
            if isinstance(client, KafkaClient) and id(client) not in closed:
                closed.add(id(client))
                with contextlib.suppress(Exception):  # half built: closing what exists is all there is to do
                    client.close()
        frame = frame.tb_next


def connect(factory: Callable[[], T], what: str, settings: KafkaSettings, attempts: int = 5) -> T:
    """Build a client, retrying a bounded number of times on an unreachable broker, or on one whose API
    versions did not answer in time (kafka-python then guesses a version too old to find the controller and
    raises ``UnrecognizedBrokerVersion``, which a loaded machine makes as transient as a broker's restart)."""
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            return new_client(factory)
        except (NoBrokersAvailable, UnrecognizedBrokerVersion) as exc:
            if attempt == attempts:
                raise BusUnavailable(
                    f"{what}: no Kafka broker answered at {settings.bootstrap_servers} after {attempts} attempts "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            _log.warning("kafka_unavailable", what=what, attempt=attempt, retry_in_s=delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")
