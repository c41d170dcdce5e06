"""rein's Kafka topology: every topic's partitions, retention and cleanup policy, in one place.

Every creator of topics goes through :func:`topic_specs` (via :func:`shared.bus.ensure_topology`):
the services that create what they need at start (collector, rollout runner), the
compose ``topics`` service (``python -m shared.topology``), ``rein up`` and the demo
(``ops/local/stack.py``), and the tests.

- ``rollout.chunks`` / ``rollout.events``: the collector's input, co-partitioned (same
  count, keyed by group id). Kept 7 days, in segments of at most 1 day. A decided group's
  records are read again only while they are not committed (a crash or a rebalance between
  the decision and the commit), and a record that a newer one follows is gone at most 8 days
  after it was written. The collector's ``decided`` marks outlive that
  (``REIN_DECIDED_TTL_S``, 14 days; it refuses to start with less), so a group whose mark
  was trimmed cannot come back, unless a collector stays down longer than the TTL with
  records read but not committed.
- ``rollout.groups``: the audit log manifests point into; the trainer reads it by offset.
  Kept 30 days (the trainer must consume a manifest's groups within that).
- ``train.batches``, ``staleness.decisions``, ``rollout.retries``: kept 7 days.
- ``weights``: one partition (a totally ordered control log), compacted and never deleted:
  the version registry is rebuilt from it. Its keys are the version (``WeightPublished``)
  and ``<version>:applied`` (``WeightApplied``), so compaction keeps one of each.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from shared.names import Topics

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicSpec:
    """How one topic is created."""

    partitions: int
    configs: dict[str, str] = field(default_factory=dict)

    def deleted_within_ms(self) -> int | None:
        """Upper bound on a record's life in this topic (retention + one segment), None if kept forever."""
        retention = int(self.configs.get("retention.ms", "-1"))
        if retention < 0 or "compact" in self.configs.get("cleanup.policy", "delete"):
            return None
        return retention + int(self.configs.get("segment.ms", str(7 * DAY_MS)))


def _deleted(days: int, segment_days: int = 1) -> dict[str, str]:
    return {"cleanup.policy": "delete", "retention.ms": str(days * DAY_MS), "segment.ms": str(segment_days * DAY_MS)}


def topic_specs(topics: Topics, partitions: int = 4) -> dict[str, TopicSpec]:
    """Topic name -> spec for every topic of ``topics``; ``partitions`` for the partitioned ones."""
    return {
        topics.chunks: TopicSpec(partitions, _deleted(7)),
        topics.events: TopicSpec(partitions, _deleted(7)),
        topics.groups: TopicSpec(partitions, _deleted(30)),
        topics.batches: TopicSpec(partitions, _deleted(7)),
        topics.decisions: TopicSpec(partitions, _deleted(7)),
        topics.retries: TopicSpec(partitions, _deleted(7)),
        topics.weights: TopicSpec(1, {"cleanup.policy": "compact", "retention.ms": "-1"}),
    }


def input_deleted_within_ms(topics: Topics, partitions: int = 4) -> int | None:
    """How long a collector input record can live at most (None: forever): the ``decided`` marks must outlive it."""
    specs = topic_specs(topics, partitions)
    bounds = [specs[t].deleted_within_ms() for t in (topics.chunks, topics.events)]
    return None if any(b is None for b in bounds) else max(b for b in bounds if b is not None)


def main(argv: list[str] | None = None) -> int:
    """``python -m shared.topology``: create every missing topic (compose's ``topics`` service)."""
    from shared.bus import ensure_topology
    from shared.settings import KafkaSettings

    parser = argparse.ArgumentParser(prog="python -m shared.topology", description=main.__doc__)
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, host:port[,host:port]")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the partitioned topics")
    args = parser.parse_args(argv)
    created = ensure_topology(KafkaSettings(bootstrap_servers=args.bootstrap), Topics(), args.partitions)
    for name, spec in topic_specs(Topics(), args.partitions).items():
        state = "created" if name in created else "exists"
        configs = " ".join(f"{k}={v}" for k, v in spec.configs.items())
        print(f"{name:24} {state:8} partitions={spec.partitions} {configs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
