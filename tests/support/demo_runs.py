"""Finished ``ops.demo`` runs written by hand, in the layout bench/time_to_reward.py reads (the summary,
the runner's ``group_ended`` lines, the trainer's metrics), so that the scripts that analyse runs can
be tested without a stack: a run they would start instead of re-reading fails, being far too slow."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

T0 = 1_800_000_000.0
"""When every run's training starts (epoch seconds)."""


def finished_run(runs: Path, mode: str, seed: int, *, reward: float, flags: list[str], steps: int = 3,
                 step_s: float = 10.0, train_s: float = 2.0, turns: int = 3, groups: int = 4) -> Path:
    """Write one finished run of ``mode`` and ``seed`` under ``runs`` (as ``--runs-dir``): ``steps`` trained
    steps ``step_s`` apart, each taking ``train_s``; ``groups`` groups of 4 episodes of ``turns`` turns, one
    ended every ``step_s``, each episode scoring ``reward``. Returns the run directory."""
    run = runs / f"{mode}-s{seed}" / "20261206-000000"
    (run / "logs").mkdir(parents=True)
    (run / "trainer").mkdir()
    (run / "summary.json").write_text(json.dumps({
        "train_started_ts": T0, "seconds_per_step": {"step_wall_s": step_s, "train_s": train_s,
                                                     "idle": {"trainer": 1 - train_s / step_s}}}))
    ended = [{"event": "group_ended", "rewards": [reward] * 4, "turns": [turns] * 4,
              "timestamp": datetime.fromtimestamp(T0 + step_s * i, UTC).isoformat()} for i in range(1, groups + 1)]
    (run / "logs" / "rollout.log").write_text("".join(json.dumps(e) + "\n" for e in ended))
    rows = [{"ts": T0 + step_s * i, "step": i, "step_time_s": train_s, "trained_tokens": 100, "samples": 16}
            for i in range(1, steps + 1)]
    (run / "trainer" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run.parent / "flags.json").write_text(json.dumps(flags))
    return run
