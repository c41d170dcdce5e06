"""The trainer's Prometheus series and the per-manifest ``metrics.jsonl`` line."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry

from services.trainer.samples import BatchSamples
from services.trainer.step import StepStats
from shared import metrics
from shared.schemas import BatchManifest
from shared.staleness import UNTRAINED_CAUSE_NAMES

# metrics.jsonl field -> Prometheus report name (rein_<name with / as _>)
GAUGES: dict[str, str] = {
    "step": "trainer/step",
    "loss": "trainer/loss",
    "reward_mean": "trainer/reward_mean",
    "train_rollout_logprob_abs_diff": "trainer/train_rollout_logprob_abs_diff",
    "train_rollout_logprob_abs_diff_same_version": "trainer/train_rollout_logprob_abs_diff_same_version",
    "same_version_tokens": "trainer/same_version_tokens",
    "clip_fraction": "trainer/clip_fraction",
    "truncated_fraction": "trainer/truncated_fraction",
    "offpolicy_masked_fraction": "trainer/offpolicy_masked_fraction",
    "offpolicy_clipped_fraction": "trainer/offpolicy_clipped_fraction",
    "offpolicy_ess": "trainer/offpolicy_ess",
    "grad_norm": "trainer/grad_norm",
    "masked_token_fraction": "trainer/masked_token_fraction",
    "trained_tokens": "trainer/trained_tokens",
    "degenerate_group_fraction": "trainer/degenerate_group_fraction",
    "version_gap_mean": "staleness/version_gap_mean",
    "version_gap_max": "staleness/version_gap_max",
    "drops_in_batch": "trainer/drops_in_batch",
    "drops_cumulative": "trainer/drops_cumulative",
    "generated_tokens_cumulative": "trainer/generated_tokens_cumulative",
    **{f"untrained_{cause}_cumulative": f"trainer/untrained_{cause}_cumulative" for cause in UNTRAINED_CAUSE_NAMES},
    "withheld_trajectories": "trainer/withheld_trajectories",
    "version_masked_tokens": "trainer/version_masked_tokens",
    "manifest_index": "trainer/manifest_index",
    "step_time_s": "trainer/step_time_s",
}


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.gauges = {field: metrics.gauge(registry, name, f"Last training step's {field}")
                       for field, name in GAUGES.items()}
        self.steps = metrics.counter(
            registry, "trainer/steps", "Optimizer steps taken (one per manifest with a gradient)")
        self.skipped = metrics.counter(
            registry, "trainer/skipped_steps",
            "Manifests consumed without an optimizer step or a new version (the batch carried no gradient)",
            ("reason",))
        self.duplicates = metrics.counter(registry, "trainer/duplicate_manifests",
                                          "Manifests dropped because their index was already trained or buffered")
        self.bad_refs = metrics.counter(registry, "trainer/bad_group_refs", "Group references that were unusable")
        self.published = metrics.counter(registry, "trainer/weights_published", "Weight versions published")
        self.buffered = metrics.gauge(registry, "trainer/buffered_manifests",
                                      "Manifests waiting for an earlier index")
        self.waiting_for = metrics.gauge(registry, "trainer/next_manifest_index", "Manifest index trained next")
        self.decode_errors = metrics.DecodeErrors(registry)

    def observe(self, line: dict[str, Any]) -> None:
        """Count the line's step or skip; gauges take its numbers (a skipped batch has no loss, grad norm, ...)."""
        for field, gauge in self.gauges.items():
            value = line.get(field)
            if isinstance(value, int | float):
                gauge.set(float(value))
        if line.get("skipped"):
            self.skipped.labels(reason=line["skipped"]).inc()
        else:
            self.steps.inc()


def step_line(
    *,
    step: int,
    manifest: BatchManifest,
    batch: BatchSamples,
    stats: StepStats,
    bad_refs: int,
    step_time_s: float,
    fetch_time_s: float,
    correction: str,
) -> dict[str, Any]:
    """The ``metrics.jsonl`` object of one consumed manifest (also what the Prometheus gauges show).

    ``step`` and ``version`` name the weights after it: for a skipped batch (``skipped`` says why)
    the ones it left unchanged, so a skip repeats the previous line's step.

    Waste: ``generated_tokens_cumulative`` and ``untrained_<cause>_cumulative`` are the manifest's
    window tally (None when the collector predates it); ``version_masked_tokens`` is this batch's
    own, so the cumulative masked tokens are the sum over the lines (one per manifest index)."""
    rewards = batch.rewards
    # The collector's gap: against the newest version among the groups it had seen when it cut the batch,
    # which may lag the weights the trainer holds by a version; same_version_tokens is the trainer's own view.
    gap = manifest.version_gap
    untrained = manifest.untrained_tokens_cumulative
    tallied = bool(untrained)
    return {
        "ts": time.time(),
        "step": step,
        "version": f"v{step}",
        "manifest_index": manifest.index,
        "batch_id": manifest.batch_id,
        "groups": len(manifest.groups),
        "trajectories": len(rewards),
        "samples": len(batch.samples),
        "loss": stats.loss,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "reward_max": max(rewards) if rewards else None,
        "reward_min": min(rewards) if rewards else None,
        "advantage_abs_mean": stats.advantage_abs_mean,
        "train_rollout_logprob_abs_diff": stats.train_rollout_logprob_abs_diff,
        "train_rollout_logprob_abs_diff_same_version": stats.train_rollout_logprob_abs_diff_same_version,
        "same_version_tokens": stats.same_version_tokens,
        "clip_fraction": stats.clip_fraction,
        "truncated_fraction": stats.truncated_fraction,
        "ratio_mean": stats.ratio_mean,
        "offpolicy_correction": correction,
        "offpolicy_masked_fraction": stats.offpolicy_masked_fraction,
        "offpolicy_clipped_fraction": stats.offpolicy_clipped_fraction,
        "offpolicy_ess": stats.offpolicy_ess,
        "grad_norm": stats.grad_norm,
        "entropy": stats.entropy,
        "updated": stats.updated,
        "skipped": stats.skipped,
        "trained_tokens": stats.trained_tokens,
        "trainable_tokens": batch.trainable_tokens,
        "version_masked_tokens": batch.version_masked_tokens,
        "masked_token_fraction": batch.masked_token_fraction,
        "degenerate_group_fraction": batch.degenerate_groups / batch.groups if batch.groups else 0.0,
        "skipped_segments": batch.skipped_segments,
        "skipped_trajectories": batch.skipped_trajectories,
        "malformed_segments": batch.malformed_segments,
        "truncated_segments": batch.truncated_segments,
        "greedy_tokens": batch.greedy_tokens,
        "bad_group_refs": bad_refs,
        "version_gap_mean": gap.mean if gap else None,
        "version_gap_min": gap.min if gap else None,
        "version_gap_max": gap.max if gap else None,
        "window_current_version": manifest.window.current_version,
        "window_current_index": manifest.window.current_index,
        "window_cutoff_index": manifest.window.cutoff_index,
        "keep_versions": manifest.window.keep_versions,
        "drops_in_batch": manifest.drops_in_batch,
        "drops_cumulative": manifest.drops_cumulative,
        "generated_tokens_cumulative": manifest.generated_tokens_cumulative if tallied else None,
        **{f"untrained_{cause}_cumulative": untrained.get(cause) for cause in UNTRAINED_CAUSE_NAMES},
        "withheld_trajectories": batch.withheld_trajectories,
        "step_time_s": step_time_s,
        "fetch_time_s": fetch_time_s,
    }
