"""The broadcaster's Prometheus metrics (served on ``/metrics`` by :mod:`services.weight_broadcaster.service`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shared import metrics


class BroadcasterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.unquiesced = metrics.counter(
            registry, "broadcaster/unquiesced", "Pause answers that failed or did not quiesce (no update followed)",
            ("proxy",))
        self.outcomes = metrics.counter(registry, "broadcaster/versions", "Weight versions handled, by outcome",
                                        ("outcome",))
        self.pause_rounds = metrics.counter(registry, "broadcaster/pause_rounds", "Pause rounds sent to the proxies")
        self.reconciles = metrics.counter(
            registry, "broadcaster/reconciles", "Times an engine served an older version and the newest was reloaded"
        )
        self.dependency_errors = metrics.counter(
            registry, "broadcaster/dependency_errors", "Loop iterations that failed on Redis or Kafka and were retried",
            ("what",),
        )
        self.leases_lost = metrics.counter(
            registry, "broadcaster/pause_leases_lost",
            "Renewals a proxy refused or missed (its pause had ended: no update followed, or it resumed mid-update)",
            ("proxy",),
        )
        self.update_failures = metrics.counter(
            registry, "broadcaster/update_failures",
            "Engine update calls that failed or after which the engine did not serve the version", ("engine",))
        self.resume_failures = metrics.counter(registry, "broadcaster/resume_failures", "Resume calls that failed",
                                               ("proxy",))
        self.staged_updates = metrics.counter(
            registry, "broadcaster/staged_updates",
            "Engine updates that swapped in the checkpoint staged before the pause (no read while paused)",
            ("engine",))
        self.lagging = metrics.counter(
            registry, "broadcaster/engines_lagging",
            "Engines found behind the newest version (reloaded) or unreachable at an update (left out)")
        self.applied_seq = metrics.gauge(registry, "broadcaster/applied_seq", "Sequence of the newest applied version")
        self.update_seconds = metrics.gauge(registry, "broadcaster/update_seconds",
                                            "Pause-to-resume time of the last applied version")
        self.decode_errors = metrics.DecodeErrors(registry)
