"""Everything a collector replica's ``/metrics`` shows, on a registry it owns (no process globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shared.metrics import DecodeErrors, counter, gauge

_SPAN_DOC = (
    "Version span {} (distinct real versions per trajectory) over the last trajectories of completed, "
    "non-failed groups on this replica"
)


class CollectorMetrics:
    """Everything ``/metrics`` shows; one registry per collector (no process globals)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decode_errors = DecodeErrors(r)
        self.groups = counter(r, "collector/groups", "Completed groups handled (rate = groups/s)", ("status",))
        self.decisions = counter(r, "staleness/decisions", "Window decisions made by this replica", ("decision",))
        self.dropped = counter(r, "staleness/dropped_groups", "Groups dropped by this replica, by reason", ("reason",))
        self.decided_tokens = counter(
            r, "staleness/decided_tokens",
            "Trainable tokens of the groups this replica decided, by decision (a kept group that a later advance "
            "drops counts under both)",
            ("decision",),
        )
        self.batches = counter(r, "collector/batches", "Batch manifests emitted by this replica's steps")
        self.published = counter(r, "collector/outbox_published", "Outbox records published by this replica")
        self.conflicts = counter(r, "collector/window_conflicts", "Window steps retried after another replica's")
        self.abandoned = counter(
            r, "collector/abandoned_groups",
            "Groups with no record for the incomplete timeout: failed (decided, retried) or dropped (never dispatched)",
            ("outcome",),
        )
        self.weight_errors = counter(r, "collector/weight_errors", "Weight records the registry refused")
        self.decided_trimmed = counter(
            r, "collector/decided_trimmed", "Decided marks forgotten after REIN_DECIDED_TTL_S"
        )
        self.commit_errors = counter(r, "collector/commit_errors", "Offset commits refused (rebalance)")
        self.outages = counter(
            r, "collector/dependency_errors", "Loop iterations that failed on Redis or Kafka and were retried",
            ("what",),
        )
        self.registry_rebuilds = counter(
            r, "collector/registry_rebuilds", "Times the Redis version registry was found short and rebuilt"
        )
        self.current_index = gauge(
            r, "staleness/current_version_index", "Registry index of the window's newest version"
        )
        self.cutoff_index = gauge(r, "staleness/cutoff_version_index", "Lowest registry index still inside the window")
        self.gap_min = gauge(r, "staleness/version_gap_min", "Version gap min of the last manifest")
        self.gap_max = gauge(r, "staleness/version_gap_max", "Version gap max of the last manifest")
        self.gap_mean = gauge(r, "staleness/version_gap_mean", "Version gap mean of the last manifest")
        self.span_min = gauge(r, "staleness/version_span_min", _SPAN_DOC.format("min"))
        self.span_max = gauge(r, "staleness/version_span_max", _SPAN_DOC.format("max"))
        self.span_mean = gauge(r, "staleness/version_span_mean", _SPAN_DOC.format("mean"))
        self.partial_rejected_groups = counter(
            r,
            "staleness/partial_rollout_rejected_groups",
            "Failed group attempts with a session rejected for partial_rollout_staleness_exceeded",
        )
        self.partial_rejected_samples = counter(
            r,
            "staleness/partial_rollout_rejected_samples",
            "Trajectories of the group attempts counted in partial_rollout_rejected_groups",
        )
        self.partial_rejected_prompts = counter(
            r,
            "staleness/partial_rollout_rejected_prompts",
            "Distinct prompts (seen by this replica) with a group rejected for partial_rollout_staleness_exceeded",
        )
        self.no_signal = counter(
            r, "collector/no_signal_groups",
            "Completed, non-failed groups whose rewards were all equal (no GRPO signal), either REIN_NO_SIGNAL_GROUPS",
        )
        self.no_signal_run = gauge(
            r, "collector/no_signal_run",
            "Groups without signal in a row across replicas, as of this replica's last step (0: the last had signal)",
        )
        self.assembling = gauge(r, "collector/assembling_groups", "Groups seen but not complete on this replica")
        self.lag = gauge(r, "collector/consumer_lag", "Records behind the partition end", ("topic", "partition"))


