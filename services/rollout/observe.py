"""The runner's Prometheus series.

They are served with ``/health`` by :class:`shared.status_server.StatusServer`, the one
metrics + health server of the services without an HTTP API of their own.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry

from services.rollout.agent import EpisodeResult
from shared import metrics


class RolloutMetrics:
    """Series of one runner, on a registry it owns."""

    def __init__(self, registry: CollectorRegistry, recent: int = 256) -> None:
        self.registry = registry
        self.episodes = metrics.counter(registry, "rollout/episodes", "Episodes ended, by outcome", ("outcome",))
        self.rejections = metrics.counter(
            registry, "rollout/rejections", "Sessions the proxy rejected, by error", ("error",)
        )
        self.failures = metrics.counter(registry, "rollout/failures", "Episodes that failed, by error", ("error",))
        self.unreported = metrics.counter(
            registry, "rollout/finish_not_delivered", "Ended episodes whose finish call never reached the proxy"
        )
        self.lost_sessions = metrics.counter(
            registry, "rollout/lost_sessions", "Sessions the runner ended as rejected because the proxy lost them"
        )
        self.lost_sessions_unpublished = metrics.counter(
            registry, "rollout/lost_sessions_unpublished", "Lost sessions whose rejection could not be published"
        )
        self.groups = metrics.counter(registry, "rollout/groups_dispatched", "Groups dispatched", ("kind",))
        self.prompt_cursor = metrics.gauge(
            registry, "rollout/prompt_cursor", "Prompts claimed from this task and seed's stream (by every runner)"
        )
        self.backend_down = metrics.gauge(
            registry, "rollout/backend_down", "1 while groups fail only because the engine, proxy or Kafka is down"
        )
        self.probes = metrics.counter(registry, "rollout/backend_probes", "Groups sent alone to probe a down backend")
        self.in_flight = metrics.gauge(registry, "rollout/groups_in_flight", "Groups whose episodes are running")
        self.reward_mean = metrics.gauge(
            registry, "rollout/reward_mean", f"Mean reward of the last {recent} completed episodes"
        )
        self.dispatch_failures = metrics.counter(
            registry, "rollout/dispatch_failures", "GroupDispatched records that could not be published"
        )
        self.duplicate_retries = metrics.counter(
            registry, "rollout/duplicate_retries", "Retry requests skipped because that prompt attempt was seen"
        )
        self.bad_retries = metrics.counter(
            registry, "rollout/bad_retries", "Retry records skipped (wrong type or unplayable prompt payload)"
        )
        self.sync_wave = metrics.gauge(registry, "rollout/sync_wave", "Sync mode: index of the current wave")
        self.sync_wait_timeouts = metrics.counter(
            registry, "rollout/sync_wait_timeouts", "Sync-mode waves opened without a new weight version (timeout)"
        )
        self.weights_seq = metrics.gauge(registry, "rollout/weights_seq", "Newest applied weight sequence seen")
        self.pacing_live = metrics.gauge(
            registry, "rollout/pacing_live_prompts", "Prompts started and not yet trained or dropped (pacing's count)"
        )
        self.pacing_capacity = metrics.gauge(
            registry, "rollout/pacing_capacity", "Most live prompts pacing allows (0 = off)"
        )
        self.pacing_held = metrics.gauge(registry, "rollout/pacing_held", "1 while pacing holds new prompts back")
        self.decode_errors = metrics.DecodeErrors(registry)
        self._recent: deque[float] = deque(maxlen=recent)

    def on_episode(self, result: EpisodeResult) -> None:
        self.episodes.labels(outcome=result.outcome).inc()
        if result.outcome == "rejected":
            self.rejections.labels(error=result.error or "unknown").inc()
        elif result.outcome == "failed":
            self.failures.labels(error=result.error or "unknown").inc()
        if result.outcome != "rejected" and not result.reported:
            self.unreported.inc()
        if result.outcome in ("completed", "truncated"):
            self._recent.append(result.reward)
            self.reward_mean.set(sum(self._recent) / len(self._recent))

    def on_pacing(self, live: int, capacity: int | None, held: bool) -> None:
        self.pacing_live.set(live)
        self.pacing_capacity.set(capacity or 0)
        self.pacing_held.set(int(held))

    @property
    def recent_reward_mean(self) -> float | None:
        return sum(self._recent) / len(self._recent) if self._recent else None
