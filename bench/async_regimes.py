"""Where asynchrony pays: sync against async with rein's controls over a grid of environment times.

An environment step (the answer to a turn, the grade: ``ops.demo --env-time``,
services/rollout/env_time.py) waits without using a core. A synchronous wave waits for its slowest
episode while the engine and the trainer idle; async hides the waits as far as it has groups in
flight. The base cell (no environment time) runs both arms first. From it come the per-turn generation
time ``g`` (the sync step's wall time less the trainer's, over the most turns an episode played) and
each arm's step time without waits. Every other cell sets the environment step's median to a
multiple of ``g`` and its log-normal sigma, and the script predicts each arm's step time before it
measures it:

    sync   S = S_sync(0)  + E[the largest summed wait of a wave's N episodes]
    async  S = S_async(0) + (G / C) * E[the largest summed wait of a group's n episodes]

N = groups per batch x group size (a sync wave is one batch); G = groups the async arm played per
trained step in the base cell (groups dropped without signal included); C = groups in flight. The
second line is Little's law: with C groups in flight, each group's end delayed by its slowest
episode's wait delays the G groups a step needs by G / C of it. The expectations are Monte Carlo
draws of the same distribution over the base runs' turns per episode. The predicted async speed-up
in trained samples is S_sync / S_async (both arms train the same batch). Sync keeps the groups
without signal (the faster fair sync, docs/benchmarks.md) and trains them with no gradient, async
drops them, so the speed-up that counts is in samples with signal: S_sync / S_async / (1 - the
share of sync's groups without signal in the base cell).

Each (cell, arm, seed) is one bench/time_to_reward.py run kept under ``--runs-dir``: the same
command again re-reads what finished and runs the rest, and ``--predict-only`` runs nothing beyond
the base cell and prints the plan with its predictions and its machine time::

    $(bash deploy/venv.sh --path)/bin/python bench/async_regimes.py --runs-dir RUNS --minutes 1.5 \\
        --out bench/async_regimes.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run_curves import analyse, ended_groups
from bench.time_to_reward import demo_flags, finished_run, run_one
from ops.report import rows_so_far
from ops.stack_flags import preset_stack

ARMS = ("sync", "async")
BASE = (0.0, 0.0)


def cell_name(multiple: float, sigma: float) -> str:
    return f"env{multiple:g}-sigma{sigma:g}"


def expected_max_wait(turns: list[int], episodes: int, median_s: float, sigma: float, draws: int,
                      seed: int = 0) -> float:
    """E[the largest of ``episodes`` episodes' summed environment waits]: each episode's turns drawn from
    ``turns``, each turn's wait log-normal with ``median_s`` and ``sigma``."""
    if median_s == 0 or not turns:
        return 0.0
    rng = random.Random(seed)
    total = 0.0
    for _ in range(draws):
        total += max(sum(median_s * math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(rng.choice(turns)))
                     for _ in range(episodes))
    return total / draws


def base_figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the predictions need from the base cell's runs (means over seeds)."""
    sync, asyn = runs["sync"], runs["async"]
    turns = [t for r in sync + asyn for t in r["turns"]]
    generation = [r["step_s"] - r["train_s"] for r in sync[:1] if r["train_s"] is not None]
    if not turns or not generation:
        raise SystemExit("the base cell's runs hold no turns or no trainer timing: rerun them on this commit")
    return {
        "turns": turns,
        "max_turns": max(turns),
        "sync_step_s": statistics.fmean(r["step_s"] for r in sync),
        "async_step_s": statistics.fmean(r["step_s"] for r in asyn),
        # the first seed's alone: it fixes every cell's environment time, so seeds added later keep it
        "generation_s": generation[0],
        "per_turn_generation_s": generation[0] / max(r for r in sync[0]["turns"]),
        "async_groups_per_step": statistics.fmean(r["groups_per_step"] for r in asyn),
        "sync_no_signal_share": statistics.fmean(r["no_signal_share"] for r in sync),
    }


def predict(base: dict[str, Any], multiple: float, sigma: float, wave: int, group: int, in_flight: int,
            draws: int) -> dict[str, float]:
    median = multiple * base["per_turn_generation_s"]
    sync = base["sync_step_s"] + expected_max_wait(base["turns"], wave, median, sigma, draws)
    asyn = base["async_step_s"] + base["async_groups_per_step"] / in_flight * expected_max_wait(
        base["turns"], group, median, sigma, draws)
    speedup = sync / asyn
    return {"env_median_s": median, "sync_step_s": sync, "async_step_s": asyn, "speedup": speedup,
            "signal_speedup": speedup / (1 - base["sync_no_signal_share"])}


def measure(run_dir: Path, minutes: float) -> dict[str, Any]:
    """One run's figures: time_to_reward's analysis, plus its step time, trainer time, turns and groups."""
    result = analyse(run_dir, minutes, [minutes], threshold=1.0, last=32)
    summary = json.loads((run_dir / "summary.json").read_text())
    end = float(summary["train_started_ts"]) + minutes * 60
    groups = [rec for ts, rec in ended_groups(run_dir / "logs" / "rollout.log") if ts <= end]
    steps = max(1, int(result["steps"]))
    timing = summary.get("seconds_per_step") or {}
    rows = rows_so_far(run_dir / "trainer" / "metrics.jsonl")  # none: no step in the budget (censored)
    trained = [r for r in rows if float(r.get("ts", math.inf)) <= end and not r.get("skipped")]
    no_signal = [float(r.get("degenerate_group_fraction") or 0.0) for r in trained]
    signal = sum(int(r.get("samples") or 0) * (1 - f) for r, f in zip(trained, no_signal, strict=True))
    return {
        "steps": result["steps"],
        "step_s": minutes * 60 / steps,
        "signal_samples_per_s": signal / (minutes * 60),
        "no_signal_share": statistics.fmean(no_signal) if no_signal else 0.0,
        "train_s": timing.get("train_s"),
        "idle": result.get("idle"),
        "trained_samples_per_s": result["trained_samples"] / (minutes * 60),
        "reward_end": result["reward_at_min"][f"{minutes:g}"],
        "turns": [int(t) for g in groups for t in g.get("turns") or []],
        "groups_per_step": len(groups) / steps,
        "run_dir": str(run_dir),
    }


def cell_runs(multiple: float, sigma: float, median_s: float, args: argparse.Namespace,
              run: bool) -> dict[str, list[dict[str, Any]]] | None:
    """Each arm's measured runs of one cell over the seeds (run now unless ``run`` is false: then None
    when any is missing)."""
    root = args.runs_dir / cell_name(multiple, sigma)
    flags = [] if median_s == 0 else [f"--env-time={median_s:.4f}", f"--env-time-sigma={sigma:g}"]
    ttr_args = argparse.Namespace(model=args.model, minutes=args.minutes, demo_flag=[*flags, *args.demo_flag],
                                  startup_timeout_s=args.startup_timeout_s)
    out: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            if run:
                run_dir = run_one(arm, seed, ttr_args, root)  # re-reads a run finished with these flags
            else:
                found = finished_run(root / f"{arm}-s{seed}", demo_flags(arm, seed, ttr_args))
                if found is None:
                    return None
                run_dir = found
            out[arm].append(measure(run_dir, args.minutes))
    return out


def fmt(v: float | None, nd: int = 3) -> str:
    """A figure of the table, or — where there is none."""
    return "—" if v is None else f"{v:.{nd}f}"


def spread(values: list[float | None]) -> str:
    """Median [min–max] of the seeds' figures; a seed without one (sync made no step) is named apart."""
    known = sorted(v for v in values if v is not None)
    missing = len(values) - len(known)
    text = f"{statistics.median(known):.2f} [{known[0]:.2f}–{known[-1]:.2f}]" if known else "—"
    return text + (f", {missing} with no sync step" if missing else "")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| env median (× g) | sigma | sync s/step measured / predicted | async s/step measured / predicted "
             "| async ÷ sync, trained samples/s | async ÷ sync, samples with signal/s "
             "| idle engine, trainer (sync / async) |",
             "|---|---|---|---|---|---|---|"]

    for r in rows:
        m = r.get("measured") or {}
        lines.append(
            f"| {r['env_median_s']:.3f} s ({r['multiple']:g}) | {r['sigma']:g} "
            f"| {fmt(m.get('sync_step_s'))} / {fmt(r['predicted']['sync_step_s'])} "
            f"| {fmt(m.get('async_step_s'))} / {fmt(r['predicted']['async_step_s'])} "
            f"| {fmt(m.get('speedup'), 2)} / {fmt(r['predicted']['speedup'], 2)} "
            f"| {fmt(m.get('signal_speedup'), 2)} / {fmt(r['predicted']['signal_speedup'], 2)} "
            f"| {m.get('idle', '—')} |")
    return "\n".join(lines)


def summarise_cell(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def mean(arm: str, key: str) -> float:
        return statistics.fmean(float(r[key]) for r in runs[arm])

    def idle(arm: str) -> str:
        shares = [r["idle"] for r in runs[arm] if r["idle"]]
        if not shares:
            return "—"
        eng = [s["engine"] for s in shares if "engine" in s]
        trainer = statistics.fmean(s["trainer"] for s in shares)
        return (f"{statistics.fmean(eng):.2f}" if eng else "—") + f", {trainer:.2f}"

    def ratio(key: str) -> float | None:
        """async ÷ sync; None when sync trained nothing in its budget (a censored cell: no ratio to give)."""
        sync = mean("sync", key)
        return mean("async", key) / sync if sync > 0 else None

    def per_seed(key: str) -> list[float | None]:
        """async ÷ sync of each seed (the arms' runs are in the seeds' order)."""
        return [a[key] / s[key] if s[key] > 0 else None for s, a in zip(runs["sync"], runs["async"], strict=True)]

    return {
        "sync_step_s": mean("sync", "step_s"), "async_step_s": mean("async", "step_s"),
        "speedup": ratio("trained_samples_per_s"), "signal_speedup": ratio("signal_samples_per_s"),
        "speedup_per_seed": per_seed("trained_samples_per_s"),
        "signal_speedup_per_seed": per_seed("signal_samples_per_s"),
        "steps": {arm: [r["steps"] for r in runs[arm]] for arm in ARMS},
        "idle": f"{idle('sync')} / {idle('async')}",
        "reward_end": {arm: [r["reward_end"] for r in runs[arm]] for arm in ARMS},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="tiny")
    p.add_argument("--minutes", type=float, default=1.5, help="training budget of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--cells", nargs="+", default=["0.25:0", "0.25:2", "1:0", "1:1", "1:2", "4:0", "4:2"],
                   help="MULTIPLE:SIGMA of the environment step beside the base cell (0:0)")
    p.add_argument("--runs-dir", type=Path, required=True, help="every run is kept here; a rerun continues")
    p.add_argument("--predict-only", action="store_true", help="run only the base cell; predict the rest")
    p.add_argument("--demo-flag", action="append", default=[], help="one more ops.demo flag for every run")
    p.add_argument("--draws", type=int, default=2000, help="Monte Carlo draws per expectation")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=Path("bench/async_regimes.json"))
    args = p.parse_args()

    demo = preset_stack(args.model)
    group = demo.setting("rollout", "group_size")
    wave = demo.batch_groups * group
    in_flight = min(demo.setting("rollout", "max_concurrent_groups"), 2 * demo.batch_groups)  # pacing: 2 x a batch
    base_runs = cell_runs(*BASE, 0.0, args, run=True)
    assert base_runs is not None
    base = base_figures(base_runs)
    speedup = base["sync_step_s"] / base["async_step_s"]
    base_predicted = {"sync_step_s": base["sync_step_s"], "async_step_s": base["async_step_s"], "speedup": speedup,
                      "signal_speedup": speedup / (1 - base["sync_no_signal_share"])}
    rows: list[dict[str, Any]] = [{"multiple": 0.0, "sigma": 0.0, "env_median_s": 0.0, "predicted": base_predicted,
                                   "measured": summarise_cell(base_runs)}]
    base_measured = rows[0]["measured"]
    print(f"{cell_name(*BASE)}: measured speed-up in samples with signal {fmt(base_measured['signal_speedup'], 2)} "
          f"(per seed {spread(base_measured['signal_speedup_per_seed'])})", flush=True)
    for cell in args.cells:
        multiple, sigma = (float(x) for x in cell.split(":"))
        predicted = predict(base, multiple, sigma, wave, group, in_flight, args.draws)
        runs = cell_runs(multiple, sigma, predicted["env_median_s"], args, run=not args.predict_only)
        rows.append({"multiple": multiple, "sigma": sigma, "env_median_s": predicted["env_median_s"],
                     "predicted": predicted, "measured": None if runs is None else summarise_cell(runs)})
        print(f"{cell_name(multiple, sigma)}: predicted speed-up in samples with signal "
              f"{predicted['signal_speedup']:.2f}"
              + ("" if runs is None else f", measured {fmt(rows[-1]['measured']['signal_speedup'], 2)} (per seed "
                 f"{spread(rows[-1]['measured']['signal_speedup_per_seed'])})"), flush=True)
    todo = sum(r["measured"] is None for r in rows) * len(ARMS) * len(args.seeds)
    print(table(rows))
    print(f"per-turn generation time g = {base['per_turn_generation_s'] * 1000:.1f} ms; runs still to do: {todo} "
          f"(about {todo * (args.minutes + 0.5):.0f} minutes)")
    base_out = {k: v for k, v in base.items() if k != "turns"}
    args.out.write_text(json.dumps({
        "model": args.model, "minutes": args.minutes, "seeds": args.seeds, "wave": wave, "group": group,
        "in_flight": in_flight, "base": base_out, "cells": rows, "runs_to_do": todo,
    }, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
