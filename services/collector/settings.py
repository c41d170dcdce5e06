"""Collector settings (``REIN_*`` environment variables); built once in ``__main__``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.settings import ServiceSettings, StopSettings
from shared.staleness import NoSignalGroups, StaleGroups


class CollectorSettings(ServiceSettings, StopSettings):
    """Settings of ``python -m services.collector`` (every replica of one deployment uses the same values)."""

    renamed: ClassVar[dict[str, str]] = {"REIN_GROUP_ID": "REIN_CONSUMER_GROUP"}

    consumer_group: str = "rein-collector"
    """Kafka consumer group of the replicas: partitions of chunks and events are split between its members."""
    replica_id: str = ""
    """Name of this replica in logs and decision records; empty: ``<hostname>-<pid>``."""
    keep_versions: int = Field(default=2, ge=0)
    """Batch window: keep groups whose versions are among the newest N (by registry order); 0 turns it off."""
    batch_groups: int = Field(default=32, ge=1)
    """Groups per training batch: a manifest is emitted each time this many groups are pending."""
    max_retries: int = Field(default=2, ge=0)
    """Retries of a failed group (so max_retries + 1 attempts) before it is dropped and counted per prompt."""
    max_free_retries: int = Field(default=10, ge=0)
    """Retries that do not count toward ``max_retries``: of groups whose failed sessions all failed
    because a dependency did (engine, proxy or Kafka down, idle or lost session, incomplete group),
    not because of the prompt or the policy. Bounded so a broken setup cannot retry forever."""
    no_signal_groups: NoSignalGroups = NoSignalGroups.DROP
    """``drop``: a group whose trajectories all got the same reward (no GRPO gradient) is decided
    ``dropped_no_signal`` and not retried, so a batch is ``batch_groups`` groups that each carry signal.
    ``keep``: such groups fill batches as any other (a batch of only them trains nothing). Under
    ``drop`` a task where no group carries signal yields no batch at all; ``rein_collector_no_signal_*``
    and a ``no_signal_groups_in_a_row`` warning show it."""
    stale_groups: StaleGroups = StaleGroups.DROP
    """``drop``: a group with a trajectory that ended outside the window is dropped whole (``dropped_stale``,
    or ``dropped_retroactive`` once pending). ``withhold``: its trajectories inside the window are kept and
    the others withheld (the manifest names them): their rewards stay in the group's baseline, their tokens
    leave the loss, counted as untrained (``withheld``); dropped whole only when none is inside. Needs a
    trainer that knows manifests' ``withheld`` field (upgrade the trainer first)."""
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
