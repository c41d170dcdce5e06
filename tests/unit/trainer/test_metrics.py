"""The trainer's metrics line and Prometheus series for a step and for a batch skipped without an update."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.trainer.metrics import TrainerMetrics, step_line
from services.trainer.samples import BatchSamples
from services.trainer.step import StepStats
from shared.schemas import BatchManifest, GroupRef, WindowInfo

MANIFEST = BatchManifest(
    batch_id="b-4", index=4, groups=[GroupRef(group_id="g", partition=0, offset=0)],
    window=WindowInfo(keep_versions=2, current_version="v3", current_index=3, cutoff_index=2),
    version_gap=None, drops_in_batch=0, drops_cumulative=0,
)
BATCH = BatchSamples(rewards=[0.2, 0.2], trajectory_group=[0, 0], groups=1, degenerate_groups=1)


def _line(stats: StepStats, step: int) -> dict[str, object]:
    return step_line(step=step, manifest=MANIFEST, batch=BATCH, stats=stats, bad_refs=0, step_time_s=0.1,
                     fetch_time_s=0.0, correction="none")


def test_a_skipped_batch_is_counted_by_reason_and_leaves_the_step_gauges_alone() -> None:
    metrics = TrainerMetrics(CollectorRegistry())
    value = metrics.registry.get_sample_value
    trained = StepStats(0.5, 8, 0.01, 0.0, 0.0, 1.0, 0.3, 0.4)
    metrics.observe(_line(trained, 3))
    skipped = StepStats(None, 8, None, None, None, None, None, 0.0, skipped="no_signal")
    line = _line(skipped, 3)
    assert (line["step"], line["version"], line["skipped"], line["updated"]) == (3, "v3", "no_signal", False)
    assert line["loss"] is None and line["grad_norm"] is None and line["reward_mean"] == 0.2
    metrics.observe(line)
    assert value("rein_trainer_skipped_steps_total", {"reason": "no_signal"}) == 1.0
    assert value("rein_trainer_steps_total") == 1.0  # the skip is no optimizer step
    assert value("rein_trainer_loss") == 0.5 and value("rein_trainer_grad_norm") == 0.3  # the last step's
    assert value("rein_trainer_manifest_index") == 4.0  # what the batch itself says is still shown
    assert _line(trained, 4)["skipped"] is None


def test_the_line_carries_the_manifests_waste_and_its_own_masked_tokens() -> None:
    manifest = MANIFEST.model_copy(update={
        "generated_tokens_cumulative": 500, "untrained_tokens_cumulative": {"window": 40, "no_signal": 24, "failed": 9},
    })
    batch = BatchSamples(rewards=[0.0, 1.0], trajectory_group=[0, 0], groups=1, trainable_tokens=30,
                         version_masked_tokens=6)
    line = step_line(step=2, manifest=manifest, batch=batch, stats=StepStats(0.5, 24, 0.01, 0.0, 0.0, 1.0, 0.3, 0.4),
                     bad_refs=0, step_time_s=0.1, fetch_time_s=0.0, correction="none")
    assert {k: line[k] for k in ("generated_tokens_cumulative", "untrained_window_cumulative",
                                 "untrained_no_signal_cumulative", "untrained_failed_cumulative",
                                 "version_masked_tokens")} == {
        "generated_tokens_cumulative": 500, "untrained_window_cumulative": 40, "untrained_no_signal_cumulative": 24,
        "untrained_failed_cumulative": 9, "version_masked_tokens": 6,
    }
    metrics = TrainerMetrics(CollectorRegistry())
    metrics.observe(line)
    assert metrics.registry.get_sample_value("rein_trainer_untrained_window_cumulative") == 40.0
    old = _line(StepStats(0.5, 8, 0.01, 0.0, 0.0, 1.0, 0.3, 0.4), 3)  # a manifest from before the tally
    assert old["generated_tokens_cumulative"] is None and old["untrained_window_cumulative"] is None
