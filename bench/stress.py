"""Staleness under stress: unprotected async against rein's controls against sync, per trained sample.

The seed article's central claim is that stale data hurts what a policy learns from
each sample and that bounding staleness recovers it. On the demo's settings a version gap of about one
step does not hurt measurably (docs/benchmarks.md, "In the demo's learning regime"), so this script
builds a regime where staleness is large: many groups in flight (``--concurrent-groups``) and a high
learning rate (``--lr``), every arm with the same flags (``--stress``; ``--env-time`` there makes the
episodes longer too). Arms (``bench/time_to_reward.py``'s modes): ``sync`` (on-policy: the reference),
``async-none`` (no window, no span cap, no pacing, every token trained under PPO's ratio) and
``async`` (rein's controls: window keep 2, span cap 2, pacing, older-version tokens masked; the pacing
admits only what the window can still train, so it also caps the groups in flight).

Learning is compared per sample, not per second: the x axis is the samples a trainer step trained
*with signal* (groups whose rewards differ; sync trains its groups without signal with no gradient,
async drops them), the y axis the mean reward of the runner's last ``--episodes`` episodes when that
step ended. Over a grid of signal-sample counts up to the fewest any run of a seed reached, each arm's
curve is averaged, and its **share of sync's curve** is that average over sync's (the claim: rein's
controls keep at least 0.9 of it, unprotected async visibly less). Each run is one ``ops.demo``, kept
under ``--runs-dir`` (the same command again continues a stopped comparison)::

    $(bash deploy/venv.sh --path)/bin/python bench/stress.py --runs-dir RUNS --minutes 3 --seeds 0 1 2 3 4 \\
        --out bench/stress.json
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run_curves import analyse
from bench.time_to_reward import run_one

ARMS = ("sync", "async-none", "async")
STRESS = ["--concurrent-groups=64", "--lr=0.003"]
"""Every arm's flags beside its mode's: 64 groups in flight (16 batches of work: with the pipeline's ~60
episodes a second a group is in flight for about 8 s, many trainer steps) and 3x the trainer's learning
rate (each step moves the policy further from what an older version sampled). No environment time by
default: it would slow sync's wave to a few steps a minute, too few samples to compare curves on."""
GRID_POINTS = 16


def signal_curve(run_dir: Path, minutes: float, episodes: int) -> dict[str, Any]:
    """One run's reward against cumulative samples with signal, its version gap and its throughput."""
    result = analyse(run_dir, minutes, [minutes], threshold=1.0, last=episodes)
    end = json.loads((run_dir / "summary.json").read_text())["train_started_ts"] + minutes * 60
    rows = [json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if float(r.get("ts", math.inf)) <= end and not r.get("skipped")]
    signal, curve = 0.0, []
    for r, (_samples, reward) in zip(steps, result["reward_by_samples"], strict=True):
        signal += int(r.get("samples") or 0) * (1 - float(r.get("degenerate_group_fraction") or 0.0))
        curve.append((signal, reward))
    gaps = [float(r["version_gap_mean"]) for r in steps if r.get("version_gap_mean") is not None]
    return {
        "steps": result["steps"],
        "signal_samples": signal,
        "curve": curve,
        "version_gap_mean": statistics.fmean(gaps) if gaps else None,
        "version_gap_max": max((int(r.get("version_gap_max") or 0) for r in steps), default=None),
        "logprob_abs_diff_mean": result["logprob_abs_diff_mean"],
        "reward_end": result["reward_at_min"][f"{minutes:g}"],
        "run_dir": str(run_dir),
    }


def reward_at(curve: list[tuple[float, float | None]], samples: float) -> float | None:
    """The reward when the run's samples with signal first reached ``samples`` (None if never, or too early)."""
    return next((reward for s, reward in curve if s >= samples), None)


def shares(by_arm: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One seed: each arm's mean reward over a common grid of signal-sample counts, and its share of sync's."""
    reach = min(r["signal_samples"] for r in by_arm.values())
    grid = [reach * (i + 1) / GRID_POINTS for i in range(GRID_POINTS)]
    means: dict[str, float | None] = {}
    for arm, r in by_arm.items():
        points = [reward_at(r["curve"], s) for s in grid]
        known = [p for p in points if p is not None]
        means[arm] = statistics.fmean(known) if len(known) == len(points) else None
    sync = means.get("sync")
    return {"grid_max_signal_samples": reach, "curve_mean": means,
            "share_of_sync": {arm: (None if m is None or not sync else m / sync) for arm, m in means.items()}}


def table(per_seed: dict[int, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> str:
    def f(v: float | None, nd: int = 3) -> str:
        return "—" if v is None else f"{v:.{nd}f}"

    def stat(values: list[float | None], nd: int = 3) -> str:
        known = [v for v in values if v is not None]
        if not known:
            return "—"
        spread = f" [{min(known):.{nd}f}–{max(known):.{nd}f}]" if len(known) > 1 else ""
        return f"{statistics.fmean(known):.{nd}f}{spread}"

    lines = ["| arm | share of sync's per-sample curve | mean reward over the grid | steps | samples with signal "
             "| version gap mean / max | \\|train − rollout logprob\\| | reward at the end |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, results in runs.items():
        gap_max = max((float(r["version_gap_max"]) for r in results if r["version_gap_max"] is not None), default=None)
        lines.append(
            f"| {arm} | {stat([s['share_of_sync'][arm] for s in per_seed.values()], 2)} "
            f"| {stat([s['curve_mean'][arm] for s in per_seed.values()])} "
            f"| {stat([float(r['steps']) for r in results], 0)} | {stat([r['signal_samples'] for r in results], 0)} "
            f"| {stat([r['version_gap_mean'] for r in results], 2)} / "
            f"{f(gap_max, 0)} "
            f"| {stat([r['logprob_abs_diff_mean'] for r in results])} | {stat([r['reward_end'] for r in results])} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="tiny")
    p.add_argument("--minutes", type=float, default=3.0, help="training budget of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--stress", type=shlex.split, default=STRESS,
                   help="ops.demo flags of every arm, as one string: --stress='--lr=0.003 ...' (default: %(default)s)")
    p.add_argument("--episodes", type=int, default=256, help="episodes in the rolling reward")
    p.add_argument("--runs-dir", type=Path, required=True, help="every run is kept here; a rerun continues")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=Path("bench/stress.json"))
    args = p.parse_args()
    if "sync" not in args.arms:
        p.error("--arms needs sync: every share is of sync's curve")

    ttr = argparse.Namespace(model=args.model, minutes=args.minutes, demo_flag=list(args.stress),
                             startup_timeout_s=args.startup_timeout_s)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    per_seed: dict[int, dict[str, Any]] = {}
    for seed in args.seeds:  # seed-major: a slow patch of the machine spreads over the arms
        by_arm = {}
        for arm in args.arms:
            by_arm[arm] = signal_curve(run_one(arm, seed, ttr, args.runs_dir), args.minutes, args.episodes)
            runs[arm].append({"seed": seed, **by_arm[arm]})
        per_seed[seed] = shares(by_arm)
        print(f"seed {seed}: share of sync's per-sample curve "
              f"{ {a: None if v is None else round(v, 3) for a, v in per_seed[seed]['share_of_sync'].items()} }",
              flush=True)
    print(table(per_seed, runs))
    args.out.write_text(json.dumps({"model": args.model, "minutes": args.minutes, "seeds": args.seeds,
                                    "stress": args.stress, "episodes_in_reward": args.episodes,
                                    "per_seed": per_seed, "runs": runs}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
