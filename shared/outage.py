"""Riding out a Redis or Kafka outage inside a service loop: back off, say so once, say when it ended.

A loop whose iteration is safe to repeat catches :data:`DEPENDENCY_ERRORS`, waits
:meth:`Outage.failed` seconds and tries again; the service stays up (its ``/health``
keeps answering) and picks up where it stopped once the dependency is back.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from kafka.errors import KafkaError
from prometheus_client import Counter

from shared.bus import BusUnavailable
from shared.state import StateUnavailable

DEPENDENCY_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    StateUnavailable,
    BusUnavailable,
    KafkaError,
)
"""Errors that mean "a dependency is down right now", not "this input is bad"."""


def dependency_of(exc: BaseException) -> str:
    """``redis``, ``kafka`` or ``timeout`` (a bounded wait of the service's own ran out)."""
    if isinstance(exc, redis.RedisError | StateUnavailable):
        return "redis"
    if isinstance(exc, BusUnavailable | KafkaError):
        return "kafka"
    return "timeout"


class Outage:
    """One outage: exponential backoff, a warning when it starts and every ``remind_s``, an info when it ends."""

    def __init__(
        self, logger: Any, errors: Counter | None = None, *, first_s: float = 0.2, cap_s: float = 5.0,
        remind_s: float = 30.0,
    ) -> None:
        self._log = logger
        self._errors = errors
        self._delay = first_s
        self._cap = cap_s
        self._remind = remind_s
        self._started = time.monotonic()
        self._last_said: float | None = None
        self.failures = 0

    def failed(self, exc: BaseException) -> float:
        """Count one failed try; returns how long to wait before the next."""
        what = dependency_of(exc)
        self.failures += 1
        if self._errors is not None:
            self._errors.labels(what=what).inc()
        now = time.monotonic()
        if self._last_said is None or now - self._last_said >= self._remind:
            self._last_said = now
            self._log.warning(
                "dependency_unavailable", dependency=what, error=f"{type(exc).__name__}: {exc}"[:300],
                down_s=round(now - self._started, 1), retry_in_s=self._delay,
            )
        delay = self._delay
        self._delay = min(self._delay * 2, self._cap)
        return delay

    def recovered(self) -> None:
        self._log.info("dependency_recovered", down_s=round(time.monotonic() - self._started, 1), tries=self.failures)


class Backoff:
    """When a call that an outage may fail is due again: every ``interval_s`` while it succeeds, after
    :class:`Outage`'s growing delay while it fails (one outage logged from its first failure to its end).
    For a call a loop makes now and then (a read of Redis between other work), not in a retry loop."""

    def __init__(self, logger: Any, interval_s: float = 0.0, *, first_s: float = 0.2, cap_s: float = 5.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._first, self._cap = first_s, cap_s
        self._outage: Outage | None = None
        self.next_at = 0.0
        """``time.monotonic()`` from when the call is due."""

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def failed(self, exc: BaseException) -> None:
        self._outage = self._outage or Outage(self._log, first_s=self._first, cap_s=self._cap)
        self.next_at = time.monotonic() + self._outage.failed(exc)

    def succeeded(self) -> None:
        if self._outage is not None:
            self._outage.recovered()
            self._outage = None
        self.next_at = time.monotonic() + self._interval
