"""What one demo run's files say about its learning: the reward curve from the rollout runner's
``group_ended`` log lines, the time to a threshold and the per-step figures from the trainer's metrics,
counted within a training budget. Read by ``bench/time_to_reward.py`` and the benches built on it."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from ops.report import rows_so_far, waste


def ended_groups(rollout_log: Path) -> list[tuple[float, dict[str, Any]]]:
    """``(epoch seconds, record)`` of every ``group_ended`` line of the runner's log (each episode's
    reward and turns), in log order; lines that are not JSON are skipped."""
    out: list[tuple[float, dict[str, Any]]] = []
    for line in rollout_log.read_text().splitlines():
        if '"group_ended"' not in line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "group_ended":
            out.append((datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp(), rec))
    return out


def episodes(rollout_log: Path) -> list[tuple[float, float]]:
    """``(epoch seconds, reward)`` of every episode of every group the runner ended, in log order."""
    return [(ts, float(r)) for ts, rec in ended_groups(rollout_log) for r in rec.get("rewards", []) if r is not None]


def reward_at(eps: list[tuple[float, float]], t: float, last: int) -> float | None:
    """Mean reward of the last ``last`` episodes ended at or before ``t``; None before ``last`` ended."""
    seen = [r for ts, r in eps if ts <= t]
    if len(seen) < last:
        return None
    return sum(seen[-last:]) / last


def time_to(eps: list[tuple[float, float]], start: float, threshold: float, last: int) -> float | None:
    """Seconds from ``start`` until the rolling reward first reaches ``threshold``; None if never."""
    rewards: list[float] = []
    for ts, r in eps:
        rewards.append(r)
        if len(rewards) >= last and sum(rewards[-last:]) / last >= threshold:
            return max(0.0, ts - start)
    return None


def analyse(run_dir: Path, minutes: float, checkpoints: list[float], threshold: float, last: int) -> dict[str, Any]:
    """One demo run's figures, counted within the training budget."""
    summary = json.loads((run_dir / "summary.json").read_text())
    start = summary.get("train_started_ts")
    if start is None:
        raise SystemExit(f"{run_dir}/summary.json has no train_started_ts (a demo from before it was recorded)")
    end = start + minutes * 60
    eps = [(ts, r) for ts, r in episodes(run_dir / "logs" / "rollout.log") if ts <= end]
    rows = [r for r in rows_so_far(run_dir / "trainer" / "metrics.jsonl") if float(r.get("ts", math.inf)) <= end]
    steps = [r for r in rows if not r.get("skipped")]
    trained = sum(int(r.get("trained_tokens") or 0) for r in steps)
    samples = 0
    by_samples: list[tuple[int, float | None]] = []
    for r in steps:
        samples += int(r.get("samples") or 0)
        by_samples.append((samples, reward_at(eps, float(r["ts"]), last)))
    return {
        "steps": len(steps),
        "older_version_logprob_diff": older_version_diffs(steps),
        "batches": len(rows),
        "episodes": len(eps),
        "reward_at_min": {f"{c:g}": reward_at(eps, start + c * 60, last) for c in checkpoints},
        "time_to_threshold_s": time_to(eps, start, threshold, last),
        "trained_tokens_per_s": trained / (minutes * 60),
        "trained_samples": samples,
        "waste": waste(rows) or {"tokens": {}, "generated": 0},
        "logprob_abs_diff_mean": summary.get("train_rollout_logprob_abs_diff_mean"),
        "masked_token_fraction_mean": summary.get("masked_token_fraction_mean"),
        "idle": (summary.get("seconds_per_step") or {}).get("idle"),
        "curve": [[round(ts - start, 1), r] for ts, r in eps],
        "reward_by_samples": by_samples,
        "run_dir": str(run_dir),
    }


def older_version_diffs(steps: list[dict[str, Any]]) -> list[float]:
    """Per trainer step, mean |train - rollout logprob| over the trained tokens an older version sampled:
    how far the policy moved since it sampled them (one version, under pacing). Steps without such
    tokens (every sync step) give none."""
    out = []
    for r in steps:
        diff, same = r.get("train_rollout_logprob_abs_diff"), int(r.get("same_version_tokens") or 0)
        trained = int(r.get("trained_tokens") or 0)
        if diff is None or trained <= same:
            continue
        same_diff = float(r.get("train_rollout_logprob_abs_diff_same_version") or 0.0)
        out.append((float(diff) * trained - same_diff * same) / (trained - same))
    return out
