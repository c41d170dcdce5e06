"""Collector settings (``REIN_*`` environment variables); built once in ``__main__``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.settings import ServiceSettings, StopSettings
from shared.staleness import WindowSettings


class CollectorSettings(ServiceSettings, StopSettings, WindowSettings):
    """Settings of ``python -m services.collector`` (every replica of one deployment uses the same values); the
    window's own (keep, batch, retries, groups without signal, stale groups) are those of
    :class:`~shared.staleness.WindowSettings`."""

    renamed: ClassVar[dict[str, str]] = {"REIN_GROUP_ID": "REIN_CONSUMER_GROUP"}

    consumer_group: str = "rein-collector"
    """Kafka consumer group of the replicas: partitions of chunks and events are split between its members."""
    replica_id: str = ""
    """Name of this replica in logs and decision records; empty: ``<hostname>-<pid>``."""
    reconfigure: bool = False
    """Overwrite the window settings stored in Redis (keep/batch/retries/no-signal/stale groups). Without it a
    replica whose values differ from the shared window's refuses to start, so replicas never disagree about the
    window."""
    metrics_host: str = "127.0.0.1"
    """Interface of the ``/metrics`` and ``/health`` HTTP server (0.0.0.0 inside a container)."""
    metrics_port: int = Field(default=9102, ge=0, le=65535)
    """Port of the ``/metrics`` and ``/health`` HTTP server; 0 picks a free port (logged at start)."""
    poll_timeout_s: float = Field(default=0.2, gt=0, le=10)
    """Longest wait of one consumer poll; bounds how fast the loop notices a stop request."""
    topic_partitions: int = Field(default=4, ge=1)
    """Partitions of topics the collector creates when missing (chunks and events must have the same count)."""
    decided_ttl_s: float = Field(default=15 * 24 * 3600.0, ge=0)
    """How long a group's ``decided`` mark is kept (0 = forever). Marks refuse a group decided
    again when its records are read twice; records can only be read again while Kafka keeps
    them, so this must exceed the input topics' retention plus one segment (the collector
    checks the broker's values at start). 15 days covers a broker's defaults (7 + 7)."""
    outbox_lock_ms: int = Field(default=10_000, ge=100)
    """Lease of the outbox publisher lock; a replica killed while publishing blocks others at most this long.
    One publish of outbox entries is bounded to half of it (then it fails and is retried)."""
    drain_interval_s: float = Field(default=2.0, gt=0)
    """How often an idle replica publishes leftover outbox entries (e.g. those of a replica that crashed)."""
    incomplete_timeout_s: float = Field(default=1800.0, gt=0)
    """A group with no new record for this long is ended as failed, so it is decided and its prompt
    retried (logged, counted); one whose ``GroupDispatched`` never came is dropped. Keep it above the
    proxy's ``session_idle_timeout_s``."""
    lag_interval_s: float = Field(default=5.0, gt=0)
    """How often consumer lag is measured for ``/metrics``."""
    registry_check_s: float = Field(default=1.0, gt=0)
    """How often the replica checks that Redis still holds every version read from ``weights``."""
