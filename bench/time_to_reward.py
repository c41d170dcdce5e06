"""Time to reward: sync vs async (with and without rein's controls), same model, seeds and wall clock.

The headline comparison. Each (seed, mode) is one ``python -m ops.demo`` run with the
same wall-clock training budget (``--minutes``, counted once every service is up), one after
another on the same machine, seed-major (every mode of seed 0, then seed 1, ...) so that a slow
patch of a shared machine spreads over the modes. Resource placement is the demo's: the trainer and
the engine each run one torch thread (one core each on two cores), but in ``sync-2t``, where each
takes both cores in its turn; the small services (proxy, collector, broadcaster, runner, Kafka,
Redis) are not pinned.

The reward of a moment is the policy's as the runner sees it: the mean reward of the last
``--episodes`` episodes the runner ended by then (its ``group_ended`` log lines), every group
counted, with or without signal, so that modes which drop or skip groups are judged alike.
Reported per mode: that reward at fixed wall-clock checkpoints (mean and spread over seeds), the
wall time to ``--threshold``, trainer steps, trained tokens/s, generated tokens never trained by
cause, and the mean |train - rollout logprob|. ``--warm-up-steps N`` first makes one short sync run and
starts every arm from its last checkpoint, so that the reward compared is the reward beyond the format.
``--from DIR`` re-reads the runs of an earlier invocation instead of running them. Prints a table,
writes JSON and a plot::

    $(bash deploy/venv.sh --path)/bin/python bench/time_to_reward.py --model smollm2 --minutes 6 \\
        --seeds 0 1 2 --out bench/time_to_reward.json --plot docs/time_to_reward.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run_curves import analyse, time_to  # noqa: E402

MODES: dict[str, list[str]] = {
    "sync": ["--mode", "sync"],
    # sync with every core to the phase that runs (the trainer's and the engine's torch threads = 2, in turn)
    "sync-2t": ["--mode", "sync", "--torch-threads", "2"],
    # rein's defaults: window keep 2, span cap 2, pacing, groups without signal dropped, stale tokens masked
    "async": ["--mode", "async"],
    # no staleness control at all: no window, no span cap, no pacing, every token trained (PPO ratio)
    "async-none": ["--mode", "async", "--keep-versions", "0", "--max-preempts", "none", "--pacing", "off",
                   "--nonlast-version-tokens", "weight"],
    # rein's controls, and an older version's tokens trained under truncated importance sampling
    "async-tis": ["--mode", "async", "--nonlast-version-tokens", "weight", "--correction", "tis"],
}
"""Mode name -> ``ops.demo`` flags."""


def finished_run(runs: Path, flags: list[str] | None = None) -> Path | None:
    """The run directory under ``runs`` (one (mode, seed)) whose demo ended with its summary and exit code 0
    (``exit_code``; a demo that failed after writing its summary is not finished), if any; with ``flags``,
    only if that run was made with the same ``ops.demo`` flags (``flags.json``)."""
    dirs = [d for d in runs.iterdir() if d.is_dir()] if runs.is_dir() else []
    done = [d for d in dirs if (d / "summary.json").is_file()]
    code = runs / "exit_code"
    if len(done) != 1 or (code.is_file() and code.read_text().strip() != "0"):
        return None
    if flags is not None:
        recorded = runs / "flags.json"
        if not recorded.is_file() or json.loads(recorded.read_text()) != flags:
            return None
    return done[0]


def demo_flags(mode: str, seed: int, args: argparse.Namespace, init: Path | None = None) -> list[str]:
    """The ``ops.demo`` flags of one (mode, seed) run, from the warm-up's checkpoint ``init`` if any: what
    ``flags.json`` records."""
    return ["--model", args.model, "--minutes", f"{args.minutes:g}", "--seed", str(seed), *MODES[mode],
            *args.demo_flag, *([] if init is None else ["--init-weights", str(init)])]


def warm_up(args: argparse.Namespace, root: Path) -> Path | None:
    """``--warm-up-steps N``: one sync run of N trainer steps (seed 0, no time budget, the model's preset and
    ``--warm-up-flag`` otherwise: ``--demo-flag``, an environment time say, is the arms'), made once under
    ``root/warm-up``; the checkpoint of its last step. Every arm loads it (``--init-weights``), so that all
    start from one policy that already keeps the format and the comparison is about the reward beyond it."""
    if not args.warm_up_steps:
        return None
    flags = ["--model", args.model, "--steps", str(args.warm_up_steps), "--minutes", "0", "--mode", "sync",
             "--seed", "0", *args.warm_up_flag]
    runs = root / "warm-up"
    if args.source is None:
        run_dir = _run(runs, flags, "warm-up", 30 * 60 + args.startup_timeout_s)
    elif (found := finished_run(runs, flags)) is not None:
        run_dir = found
    else:
        raise SystemExit(f"{runs}: no finished warm-up run made with {flags} to re-read")
    sidecar = run_dir / "weights" / f"v{args.warm_up_steps}.json"
    if not sidecar.is_file():
        raise SystemExit(f"warm-up: no checkpoint of step {args.warm_up_steps} in {run_dir / 'weights'}")
    return Path(json.loads(sidecar.read_text())["path"])


def run_one(mode: str, seed: int, args: argparse.Namespace, root: Path, init: Path | None = None) -> Path:
    """Run the demo once (from the warm-up's checkpoint ``init`` if any); its run directory."""
    return _run(root / f"{mode}-s{seed}", demo_flags(mode, seed, args, init), f"{mode} seed {seed}",
                args.minutes * 60 + args.startup_timeout_s, keep_weights=False)


def _run(runs: Path, flags: list[str], label: str, timeout_s: float, *, keep_weights: bool = True) -> Path:
    """Run ``ops.demo`` with ``flags`` under ``runs``; its run directory. A run that ended before with the
    same flags (its summary written, exit code 0) is re-read, not repeated, so that the same command continues
    an invocation that was stopped; what a stopped or failed run left behind is removed and that run starts
    again. A finished run made with other flags is never overwritten: that is an error. Without
    ``keep_weights`` the run's checkpoints are removed once it ends (the analysis reads its metrics and logs;
    SmolLM2 leaves about 3 GB a run, which a grid of dozens of runs would pile up)."""
    done = finished_run(runs, flags)
    if done is not None:
        print(f"{label}: finished before, re-read from {done}", flush=True)
        return done
    if finished_run(runs) is not None:
        raise SystemExit(f"{runs} holds a finished run made with other flags (its flags.json): "
                         "give this comparison its own --runs-dir")
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    (runs / "flags.json").write_text(json.dumps(flags))
    cmd = [sys.executable, "-m", "ops.demo", *flags, "--runs-dir", str(runs)]
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {' '.join(cmd[2:])}", flush=True)
    with (runs / "demo.out").open("w") as out:
        code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False,
                              timeout=timeout_s).returncode
    (runs / "exit_code").write_text(f"{code}\n")
    found = finished_run(runs)
    if code != 0 or found is None:
        raise SystemExit(f"{label}: demo exited {code}; see {runs / 'demo.out'}")
    if not keep_weights:
        shutil.rmtree(found / "weights", ignore_errors=True)
    return found


def _stats(values: list[float | None]) -> dict[str, float | int | None]:
    known = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(known) if known else None,
        "min": min(known, default=None),
        "max": max(known, default=None),
        "n": len(known),
    }


def aggregate(runs: dict[str, list[dict[str, Any]]], checkpoints: list[float]) -> dict[str, dict[str, Any]]:
    """Per mode: each figure's mean and spread over seeds (a time to threshold never reached counts in ``n``)."""
    out: dict[str, dict[str, Any]] = {}
    for mode, results in runs.items():
        causes = sorted({c for r in results for c in r["waste"]["tokens"]})
        generated = sum(int(r["waste"]["generated"]) for r in results)
        out[mode] = {
            "seeds": len(results),
            "reward_at_min": {f"{c:g}": _stats([r["reward_at_min"][f"{c:g}"] for r in results]) for c in checkpoints},
            "time_to_threshold_s": _stats([r["time_to_threshold_s"] for r in results]),
            "steps": _stats([float(r["steps"]) for r in results]),
            "trained_tokens_per_s": _stats([r["trained_tokens_per_s"] for r in results]),
            "untrained_share_by_cause": {
                c: sum(int(r["waste"]["tokens"].get(c, 0)) for r in results) / generated
                for c in causes
            } if generated else {},
            "logprob_abs_diff_mean": _stats([r["logprob_abs_diff_mean"] for r in results]),
            "policy_move": _move([d for r in results for d in r["older_version_logprob_diff"]]),
        }
    return out


def rolling_best(curve: list[list[float]], last: int) -> float | None:
    """The highest mean reward of ``last`` consecutive episodes of a run's curve."""
    rewards = [float(r) for _, r in curve]
    means = [sum(rewards[j - last:j]) / last for j in range(last, len(rewards) + 1)]
    return max(means, default=None)


def times_to_sync_best(runs: dict[str, list[dict[str, Any]]], fractions: list[float],
                       last: int) -> dict[str, Any] | None:
    """Seconds each run took to a rolling reward of each fraction of sync's best (the highest rolling reward any
    seed of a sync mode, either placement, reached within the budget): per mode and fraction, every seed's time
    in seed order (None: not reached, a censored run) and their median over the seeds that reached it. None
    without sync runs."""
    synced = [r for mode, results in runs.items() if mode.startswith("sync") for r in results]
    best = max((b for r in synced if (b := rolling_best(r["curve"], last)) is not None), default=None)
    if best is None:
        return None
    out: dict[str, Any] = {"sync_best": best, "modes": {}}
    for mode, results in runs.items():
        per: dict[str, Any] = {}
        for frac in fractions:
            times = [time_to([(float(t), float(x)) for t, x in r["curve"]], 0.0, frac * best, last) for r in results]
            reached = sorted(t for t in times if t is not None)
            per[f"{frac:g}"] = {"level": frac * best, "seconds": times, "reached": len(reached),
                                "median_reached_s": statistics.median(reached) if reached else None}
        out["modes"][mode] = per
    return out


def _move(diffs: list[float]) -> dict[str, float | int | None]:
    """The per-step policy move (:func:`bench.run_curves.older_version_diffs`) over every step of every seed:
    median, max and their ratio (how far the largest single step moved the policy against a usual one)."""
    if not diffs:
        return {"steps": 0, "median": None, "max": None, "max_over_median": None}
    median = statistics.median(diffs)
    return {"steps": len(diffs), "median": median, "max": max(diffs),
            "max_over_median": max(diffs) / median if median > 0 else None}


def _fmt(stat: dict[str, Any], digits: int = 3) -> str:
    if stat["mean"] is None:
        return "-"
    spread = "" if stat["n"] < 2 else f" [{stat['min']:.{digits}f}-{stat['max']:.{digits}f}]"
    return f"{stat['mean']:.{digits}f}{spread}"


def table(agg: dict[str, dict[str, Any]], checkpoints: list[float], threshold: float) -> str:
    cols = [f"reward @{c:g} min" for c in checkpoints]
    head = ["mode", *cols, f"time to {threshold:g} (s)", "steps", "trained tok/s", "untrained by cause", "|dlogp|",
            "step move median / max"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for mode, a in agg.items():
        ttt = a["time_to_threshold_s"]
        reached = f"{_fmt(ttt, 0)} ({ttt['n']}/{a['seeds']})"
        waste = ", ".join(f"{c} {s:.0%}" for c, s in a["untrained_share_by_cause"].items() if s) or "0"
        lines.append(" | ".join([
            mode, *(_fmt(a["reward_at_min"][f"{c:g}"]) for c in checkpoints), reached, _fmt(a["steps"], 1),
            _fmt(a["trained_tokens_per_s"], 1), waste, _fmt(a["logprob_abs_diff_mean"], 3),
            "-" if a["policy_move"]["median"] is None
            else f"{a['policy_move']['median']:.3f} / {a['policy_move']['max']:.3f}",
        ]))
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], out: Path, minutes: float, last: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(zip(runs, ["tab:green", "tab:blue", "tab:orange", "tab:purple", "tab:red"], strict=False))
    for mode, results in runs.items():
        for i, r in enumerate(results):
            curve = r["curve"]
            rolled = [(t, sum(x for _, x in curve[j - last + 1 : j + 1]) / last)
                      for j, (t, _) in enumerate(curve) if j + 1 >= last]
            label = mode if i == 0 else None
            by_time.plot([t / 60 for t, _ in rolled], [v for _, v in rolled], color=colors[mode], alpha=0.7,
                         linewidth=1.2, label=label)
            pts = [(s, v) for s, v in r["reward_by_samples"] if v is not None]
            by_samples.plot([s for s, _ in pts], [v for _, v in pts], color=colors[mode], alpha=0.7, linewidth=1.2,
                            marker=".", label=label)
    by_time.set_xlabel("wall-clock training time (min)")
    by_time.set_xlim(0, minutes)
    by_time.set_title(f"reward of the last {last} episodes", fontsize=10)
    by_samples.set_xlabel("trained samples")
    by_samples.set_title("reward at each trainer step", fontsize=10)
    for ax in (by_time, by_samples):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--minutes", type=float, default=6.0, help="training wall-clock budget of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--threshold", type=float, default=0.18, help="reward whose wall time is reported")
    p.add_argument("--episodes", type=int, default=16, help="episodes in the rolling reward")
    p.add_argument("--of-sync-best", type=float, nargs="+", default=[0.5, 0.75, 0.9],
                   help="fractions of sync's best rolling reward whose time to reach is reported per run")
    p.add_argument("--checkpoints", type=float, nargs="+", default=None,
                   help="minutes at which the reward is reported (default: every minute of the budget)")
    p.add_argument("--demo-flag", action="append", default=[], help="one more ops.demo flag for every run")
    p.add_argument("--warm-up-steps", type=int, default=0,
                   help="first one sync run of this many trainer steps (seed 0), made once; every arm starts from "
                        "its last checkpoint (ops.demo --init-weights). 0: every arm starts from fresh weights")
    p.add_argument("--warm-up-flag", action="append", default=[], help="one more ops.demo flag for the warm-up run")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="keep the runs here (default: a temporary dir); a run already finished there is re-read, "
                        "so the same command continues an invocation that was stopped")
    p.add_argument("--from", dest="source", type=Path, default=None,
                   help="re-read the runs of an earlier invocation's --runs-dir instead of running")
    p.add_argument("--out", type=Path, default=Path("bench/time_to_reward.json"))
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    checkpoints = args.checkpoints or [float(m) for m in range(1, int(args.minutes) + 1)] or [args.minutes]

    root = args.source or args.runs_dir or Path(tempfile.mkdtemp(prefix="rein-ttr-"))
    started = time.time()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    init: Path | None = None
    try:
        init = warm_up(args, root)
        for seed in args.seeds:
            for mode in args.modes:
                if args.source is not None:
                    found = finished_run(root / f"{mode}-s{seed}")
                    if found is None:
                        raise SystemExit(f"{root / f'{mode}-s{seed}'}: no finished run to re-read")
                    run_dir = found
                else:
                    run_dir = run_one(mode, seed, args, root, init)
                result = analyse(run_dir, args.minutes, checkpoints, args.threshold, args.episodes)
                runs[mode].append({"seed": seed, **result})
                print(f"  {mode} seed {seed}: {result['steps']} steps, reward "
                      f"{[result['reward_at_min'][f'{c:g}'] for c in checkpoints]}", flush=True)
    finally:
        if args.source is None and args.runs_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    agg = aggregate(runs, checkpoints)
    print(table(agg, checkpoints, args.threshold))
    to_best = times_to_sync_best(runs, args.of_sync_best, args.episodes)
    if to_best is not None:
        print(f"seconds to a fraction of sync's best rolling reward ({to_best['sync_best']:.3f}), per seed "
              "(- not reached):")
        for mode, per in to_best["modes"].items():
            cells = (f"{frac}: " + " ".join("-" if t is None else f"{t:.0f}" for t in v["seconds"])
                     for frac, v in per.items())
            print(f"  {mode}: " + "; ".join(cells))
    result = {
        "model": args.model, "minutes": args.minutes, "seeds": args.seeds, "threshold": args.threshold,
        "episodes_in_reward": args.episodes, "checkpoints_min": checkpoints,
        "modes": {m: MODES[m] + args.demo_flag for m in args.modes}, "wall_s": round(time.time() - started, 1),
        "warm_up": None if init is None else {"steps": args.warm_up_steps, "flags": args.warm_up_flag,
                                              "checkpoint": str(init)},
        "aggregate": agg, "time_to_sync_best": to_best, "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1))
    if args.plot is not None:
        plot(runs, args.plot, args.minutes, args.episodes)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
