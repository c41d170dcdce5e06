"""The Kafka adapter's pure parts: one overall bound on a batch of acks; a group member's trail."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import structlog
from kafka.errors import KafkaTimeoutError

from shared import log
from shared.bus import BusUnavailable, Producer
from shared.bus.consumer import _trail
from shared.schemas import WeightApplied


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

    def get(self, timeout: float) -> _Meta:
        self.waits.append(timeout)
        if timeout < self.ack_after_s:
            raise KafkaTimeoutError("not acked in time")
        return _Meta()


class _Client:
    def __init__(self, futures: list[_Future]) -> None:
        self.futures = list(futures)

    def send(self, topic: str, value: bytes, key: bytes) -> _Future:
        return self.futures.pop(0)


def _producer(futures: list[_Future], timeout_s: float = 30.0) -> Producer:
    producer = Producer.__new__(Producer)  # no broker: only the waiting logic is under test
    producer._timeout_s = timeout_s
    producer._producer = _Client(futures)  # type: ignore[assignment]
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
