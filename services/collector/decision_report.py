"""What a collector replica counts and logs about its window's decisions (metrics and log lines, no state).

Apart from :class:`~services.collector.service.Collector`'s loop, which only calls it: each window
step's decisions and batch, the run of groups without signal, and each decided group's version
spans and partial-rollout rejections.
"""

from __future__ import annotations

from services.collector.assembly import RecentSpans, SeenOnce, partial_rollout_rejected_samples, version_spans
from services.collector.metrics import CollectorMetrics
from services.collector.window_store import StepOutcome
from shared import log
from shared.schemas import CompletedGroup
from shared.staleness import Decision, NoSignalGroups, StepResult, WindowGroup, WindowSettings

_log = log.get(__name__)

NO_SIGNAL_WARN_BATCHES = 4
"""Warn each time this many batches' worth of groups in a row (all replicas) carried no signal."""


class DecisionReport:
    """One replica's counters and logs of window decisions."""

    def __init__(self, metrics: CollectorMetrics, config: WindowSettings) -> None:
        self.metrics = metrics
        self.config = config
        self.spans = RecentSpans()
        self.rejected_prompts = SeenOnce()

    def outcome(self, outcome: StepOutcome) -> None:
        """Decision counters, gauges and a log line per decision of one window step, and its batch if any."""
        if outcome.result is None:
            return
        for d in outcome.result.decisions:
            self.metrics.decisions.labels(decision=d.decision.value).inc()
            self.metrics.decided_tokens.labels(decision=d.decision.value).inc(d.tokens)
            if d.decision is not Decision.KEPT and d.decision is not Decision.FAILED_RETRY:
                self.metrics.dropped.labels(reason=d.decision.value).inc()
            log_fn = _log.info if d.decision is Decision.KEPT else _log.warning
            log_fn(
                "group_decided",
                group_id=d.group_id,
                prompt_id=d.prompt_id,
                attempt=d.attempt,
                decision=d.decision.value,
                versions=list(d.versions),
                tokens=d.tokens,
                current=d.window.current_version,
                cutoff_index=d.window.cutoff_index,
                step=outcome.step,
            )
        snap = outcome.result.decisions[-1].window
        if snap.current_index is not None:
            self.metrics.current_index.set(snap.current_index)
        if snap.cutoff_index is not None:
            self.metrics.cutoff_index.set(snap.cutoff_index)
        batch = outcome.result.batch
        if batch is not None:
            self.metrics.batches.inc()
            if batch.gap is not None:
                self.metrics.gap_min.set(batch.gap.min)
                self.metrics.gap_max.set(batch.gap.max)
                self.metrics.gap_mean.set(batch.gap.mean)
            _log.info("batch_taken", index=batch.index, groups=len(batch.groups), drops=len(batch.dropped))

    def signal(self, view: WindowGroup, result: StepResult) -> None:
        """Counts a non-failed group without signal; warns each time the shared run of them reaches
        another ``NO_SIGNAL_WARN_BATCHES`` batches' worth (one replica's step reaches each multiple)."""
        run = result.state.no_signal_run
        self.metrics.no_signal_run.set(run)
        if view.signal:
            return
        self.metrics.no_signal.inc()
        every = self.config.batch_groups * NO_SIGNAL_WARN_BATCHES
        if run % every == 0:
            dropping = self.config.no_signal_groups is NoSignalGroups.DROP
            _log.warning(
                "no_signal_groups_in_a_row",
                groups=run,
                no_signal_groups=self.config.no_signal_groups.value,
                note=(
                    "every trajectory of each of these groups got the same reward: "
                    + ("they were dropped, so the trainer gets no batch until a group carries signal"
                       if dropping else "the batches they fill train nothing")
                    + " (check the task's rewards, or the policy's collapse)"
                ),
            )

    def staleness(self, group: CompletedGroup) -> None:
        """Span gauges and partial-rollout rejection counters of one newly decided group."""
        self.spans.add(version_spans(group))
        stats = self.spans.stats()
        if stats is not None:
            self.metrics.span_min.set(stats.min)
            self.metrics.span_max.set(stats.max)
            self.metrics.span_mean.set(stats.mean)
        samples = partial_rollout_rejected_samples(group)
        if samples:
            self.metrics.partial_rejected_groups.inc()
            self.metrics.partial_rejected_samples.inc(samples)
            if self.rejected_prompts.add(group.prompt_id):
                self.metrics.partial_rejected_prompts.inc()
