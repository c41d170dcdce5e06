"""Outage bookkeeping: backoff, one warning per outage (plus reminders), which dependency failed."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from kafka.errors import KafkaTimeoutError
from prometheus_client import CollectorRegistry, Counter

from shared.bus import BusUnavailable
from shared.outage import DEPENDENCY_ERRORS, Backoff, Outage, dependency_of
from shared.state import StateUnavailable


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append(("info", event, kw))


@pytest.mark.parametrize(
    ("exc", "what"),
    [
        (redis.ConnectionError("refused"), "redis"),
        (redis.TimeoutError("slow"), "redis"),
        (StateUnavailable("no redis"), "redis"),
        (BusUnavailable("no broker"), "kafka"),
        (KafkaTimeoutError("metadata"), "kafka"),
        (TimeoutError("lease"), "timeout"),
    ],
)
def test_dependency_of(exc: BaseException, what: str) -> None:
    assert dependency_of(exc) == what


def test_dependency_errors_are_not_input_errors() -> None:
    assert not any(issubclass(ValueError, t) or issubclass(KeyError, t) for t in DEPENDENCY_ERRORS)


def test_backoff_doubles_to_the_cap_and_counts_by_dependency() -> None:
    registry = CollectorRegistry()
    errors = Counter("errs", "e", ("what",), registry=registry)
    log = Log()
    outage = Outage(log, errors, first_s=0.2, cap_s=1.0, remind_s=3600)
    delays = [outage.failed(redis.ConnectionError("x")) for _ in range(5)]
    assert delays == [0.2, 0.4, 0.8, 1.0, 1.0]
    outage.failed(BusUnavailable("y"))
    assert registry.get_sample_value("errs_total", {"what": "redis"}) == 5
    assert registry.get_sample_value("errs_total", {"what": "kafka"}) == 1
    assert [e for lvl, e, _ in log.lines] == ["dependency_unavailable"]  # said once, not six times
    outage.recovered()
    assert log.lines[-1][:2] == ("info", "dependency_recovered") and log.lines[-1][2]["tries"] == 6


def test_a_long_outage_is_reminded() -> None:
    log = Log()
    outage = Outage(log, remind_s=0.0)
    outage.failed(redis.ConnectionError("x"))
    outage.failed(redis.ConnectionError("x"))
    assert [e for _, e, _ in log.lines] == ["dependency_unavailable", "dependency_unavailable"]


def test_a_backoff_paces_successes_and_backs_off_failures_each_outage_logged_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    logger = Log()
    calls = Backoff(logger, interval_s=0.5, first_s=0.2, cap_s=1.0)
    assert calls.due()
    calls.succeeded()
    assert not calls.due() and calls.next_at == 100.5
    now[0] = 100.5
    assert calls.due()
    for expected in (0.2, 0.4, 0.8, 1.0):  # doubling to the cap
        calls.failed(redis.ConnectionError("down"))
        assert calls.next_at == pytest.approx(now[0] + expected)
        now[0] = calls.next_at
    calls.succeeded()
    assert calls.next_at == pytest.approx(now[0] + 0.5)
    assert [event for _, event, _ in logger.lines] == ["dependency_unavailable", "dependency_recovered"]
    calls.failed(redis.ConnectionError("down again"))  # a new outage starts from the first delay
    assert calls.next_at == pytest.approx(now[0] + 0.2)
