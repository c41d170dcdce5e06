"""The Kafka adapter's pure parts: one overall bound on a batch of acks; a group member's trail."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import structlog
from kafka.errors import KafkaTimeoutError, UnrecognizedBrokerVersion

from shared import log
from shared.bus import BusUnavailable, Producer
from shared.bus.client import connect
from shared.bus.consumer import IDLE_FETCH_MAX_WAIT_MS, _trail, fetch_limits
from shared.schemas import WeightApplied
from shared.settings import KafkaSettings


@dataclass
class _Meta:
    topic: str = "t"
    partition: int = 0
    offset: int = 0


@dataclass
class _Future:
    """Acked after ``ack_after_s`` of waiting (a slow broker); records every wait's timeout."""

    ack_after_s: float
    waits: list[float] = field(default_factory=list)

    errbacks: list[Callable[[BaseException], None]] = field(default_factory=list)

    def get(self, timeout: float) -> _Meta:
        self.waits.append(timeout)
        if timeout < self.ack_after_s:
            raise KafkaTimeoutError("not acked in time")
        return _Meta()

    def add_callback(self, fn: Callable[[_Meta], None]) -> _Future:
        return self

    def add_errback(self, fn: Callable[[BaseException], None]) -> _Future:
        self.errbacks.append(fn)
        return self

    def fail(self, error: BaseException) -> None:
        for fn in self.errbacks:
            fn(error)


class _Client:
    def __init__(self, futures: list[_Future]) -> None:
        self.futures = list(futures)
        self.closed = threading.Event()

    def send(self, topic: str, value: bytes, key: bytes) -> _Future:
        return self.futures.pop(0)

    def close(self, timeout: float) -> None:
        self.closed.set()


def _producer(futures: list[_Future], timeout_s: float = 30.0) -> Producer:
    producer = Producer.__new__(Producer)  # no broker: only the client logic is under test
    producer._timeout_s = timeout_s
    producer._client_id = "test"
    producer._delivery_timeout_ms = 1000
    producer._expired = threading.Event()
    producer._rebuild_lock = threading.Lock()
    producer._next_rebuild = 0.0
    producer.replacements = 0
    producer._producer = _Client(futures)
    return producer


def _record() -> WeightApplied:
    return WeightApplied(version="v1", seq=1, digest="d")


def test_send_many_waits_once_for_the_whole_batch_not_once_per_record() -> None:
    futures = [_Future(0.0) for _ in range(5)]
    assert len(_producer(futures).send_many([("t", _record())] * 5, timeout_s=2.0)) == 5
    waits = [w for f in futures for w in f.waits]
    assert all(0.0 <= w <= 2.0 for w in waits)  # each wait gets what is left of the one bound


def test_send_many_fails_when_the_bound_runs_out() -> None:
    futures = [_Future(0.0), _Future(5.0)]
    with pytest.raises(BusUnavailable, match="producing to Kafka failed"):
        _producer(futures).send_many([("t", _record())] * 2, timeout_s=1.0)
    assert futures[1].waits and futures[1].waits[0] <= 1.0


def test_an_expired_delivery_makes_the_next_send_use_a_new_client_and_retires_the_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kafka-python 2.3 can leave partitions muted for good once a delivery expired (shared/bus/producer.py)."""
    first = _Future(0.0)
    producer = _producer([first, _Future(0.0)])
    old = producer._producer
    fresh = _Client([_Future(0.0)])
    builds: list[int] = []

    def build(attempts: int) -> _Client:
        builds.append(attempts)
        return fresh

    monkeypatch.setattr(producer, "_build", build)
    producer.send_async("t", _record())
    producer.send_async("t", _record())  # nothing expired yet: the same client
    assert builds == [] and producer._producer is old
    first.fail(KafkaTimeoutError("Expiring 1 record(s) for t-0: 3000 ms has passed since batch creation"))
    producer.send_async("t", _record())
    assert builds == [1] and producer._producer is fresh and producer.replacements == 1
    assert old.closed.wait(5), "the replaced client was not closed"


def test_other_failures_keep_the_client_and_a_failed_rebuild_waits_before_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = _Future(0.0), _Future(0.0)
    producer = _producer([first, second, _Future(0.0), _Future(0.0)])
    old = producer._producer
    builds: list[int] = []

    def build(attempts: int) -> _Client:
        builds.append(attempts)
        raise BusUnavailable("no broker")

    monkeypatch.setattr(producer, "_build", build)
    producer.send_async("t", _record())
    first.fail(BusUnavailable("a record too large"))  # not an expiry: nothing to replace
    producer.send_async("t", _record())
    assert builds == []
    second.fail(KafkaTimeoutError("Expiring 1 record(s)"))
    producer.send_async("t", _record())  # the broker is still down: the old client goes on
    producer.send_async("t", _record())  # within REBUILD_RETRY_S of the failed try: no new one
    assert builds == [1] and producer._producer is old and producer.replacements == 0


def test_a_group_members_trail_names_where_each_partition_starts_and_any_gap(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log.configure("test", "info", json=True)
    try:
        resumed: dict[str, int] = {}
        _trail("t", 2, None, 40, resumed)  # first record of the assignment
        _trail("t", 2, 40, 41, resumed)  # contiguous: nothing to say
        _trail("t", 2, 41, 45, resumed)  # 42..44 never came
        assert resumed == {"t/2": 40}
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [(e["event"], e["after"], e["offset"]) for e in lines] == [("offset_gap", 41, 45)]
    finally:
        structlog.reset_defaults()


def test_a_client_whose_broker_versions_did_not_answer_in_time_is_built_again() -> None:
    """A loaded broker's late ApiVersions answer makes kafka-python's admin client raise
    ``UnrecognizedBrokerVersion`` in its constructor: a transient failure, retried like an unreachable broker."""
    tries: list[int] = []

    def factory() -> str:
        tries.append(1)
        if len(tries) < 2:
            raise UnrecognizedBrokerVersion("cannot determine the controller")
        return "client"

    assert connect(factory, "admin", KafkaSettings(bootstrap_servers="127.0.0.1:1")) == "client"
    assert len(tries) == 2


def test_fetch_limits_batch_when_busy_and_wait_long_for_any_record_when_idle() -> None:
    batched = KafkaSettings(fetch_min_bytes=65536, fetch_max_wait_ms=20)
    assert fetch_limits(batched, idle=False) == (65536, 20)
    assert fetch_limits(batched, idle=True) == (1, IDLE_FETCH_MAX_WAIT_MS)
    slow = KafkaSettings(fetch_min_bytes=1, fetch_max_wait_ms=2000)  # a wait above the idle one is kept
    assert fetch_limits(slow, idle=True) == fetch_limits(slow, idle=False) == (1, 2000)
