"""bench/async_regimes.py on runs written by hand: a cell where sync trained nothing in its budget."""

from __future__ import annotations

from pathlib import Path

from bench.async_regimes import measure, spread, summarise_cell, table
from tests.support.demo_runs import finished_run


def test_a_sync_that_made_no_step_gives_no_ratio_not_an_infinite_one(tmp_path: Path) -> None:
    # ops.demo stopped by its time budget before the trainer's first step: a summary and no metrics file
    sync = finished_run(tmp_path, "sync", 0, reward=0.0, flags=[], steps=0, groups=0)
    (sync / "trainer" / "metrics.jsonl").unlink()
    async_ = finished_run(tmp_path, "async", 0, reward=0.2, flags=[], steps=3)
    runs = {"sync": [measure(sync, 0.5)], "async": [measure(async_, 0.5)]}
    assert runs["sync"][0]["steps"] == 0 and runs["sync"][0]["signal_samples_per_s"] == 0
    assert runs["sync"][0]["step_s"] == 30  # at least the whole budget: censored
    cell = summarise_cell(runs)
    assert cell["speedup"] is None and cell["signal_speedup"] is None and cell["signal_speedup_per_seed"] == [None]
    assert spread([2.0, None, 1.0, 4.0]) == "2.00 [1.00–4.00], 1 with no sync step"
    predicted = {"sync_step_s": 40.0, "async_step_s": 10.0, "speedup": 4.0, "signal_speedup": 5.0}
    row = table([{"env_median_s": 1.0, "multiple": 1.0, "sigma": 2.0, "predicted": predicted, "measured": cell}])
    assert "| — / 4.00 | — / 5.00 |" in row
