"""``make demo``: the whole pipeline learning the built-in task on CPU, with progress.

Starts Kafka, Redis and every service as local processes (``ops.local.stack``), runs
a fixed number of trainer steps with ``keep_versions=2``, partial rollout on and
``max_preempts=2``, shows one progress line per step (reward, version gap, drops,
rejections), stops every process it started (also on Ctrl-C), and writes
``runs/<id>/summary.json`` and ``runs/<id>/plot.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from ops.local.launcher import LaunchError
from ops.local.stack import LocalStack, StackConfig, start
from ops.report import plot_run, rows_so_far

_REJECTIONS = re.compile(r"^rein_proxy_rejections_total\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make demo", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=80, help="trainer steps to run (default 80, about 10 minutes)")
    p.add_argument("--keep-versions", type=int, default=2)
    p.add_argument("--max-preempts", type=int, default=2)
    p.add_argument("--collectors", type=int, default=2)
    p.add_argument("--batch-groups", type=int, default=8, help="GRPO groups per training batch")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--concurrent-groups", type=int, default=16)
    p.add_argument("--mode", choices=["async", "sync"], default="async")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument("--timeout-min", type=float, default=30.0, help="give up after this many minutes")
    return p.parse_args(argv)


def proxy_rejections(url: str) -> int:
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return -1
    return int(sum(float(v) for v in _REJECTIONS.findall(text)))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict[str, Any]], rejections: int, wall_s: float, config: StackConfig) -> dict[str, Any]:
    rewards = [float(r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    k = max(1, min(5, len(rewards) // 4 or 1))
    gaps = [float(r["version_gap_mean"]) for r in rows if r.get("version_gap_mean") is not None]
    diffs = [
        float(r["train_rollout_logprob_abs_diff"]) for r in rows if r.get("train_rollout_logprob_abs_diff") is not None
    ]
    masked = [float(r["masked_token_fraction"]) for r in rows if r.get("masked_token_fraction") is not None]
    start_reward, end_reward = _mean(rewards[:k]), _mean(rewards[-k:])
    return {
        "steps": len(rows),
        "wall_s": round(wall_s, 1),
        "reward_start": start_reward,
        "reward_end": end_reward,
        "reward_window_steps": k,
        "learned": start_reward is not None and end_reward is not None and end_reward > start_reward,
        "version_gap_mean": _mean(gaps),
        "version_gap_max": max(
            (int(r["version_gap_max"]) for r in rows if r.get("version_gap_max") is not None), default=None
        ),
        "train_rollout_logprob_abs_diff_mean": _mean(diffs),
        "masked_token_fraction_mean": _mean(masked),
        "dropped_groups": rows[-1].get("drops_cumulative") if rows else None,
        "rejected_sessions": rejections,
        "settings": {
            "keep_versions": config.keep_versions,
            "max_preempts": config.max_preempts,
            "partial_rollout": config.partial_rollout,
            "collectors": config.collectors,
            "batch_groups": config.batch_groups,
            "group_size": config.group_size,
            "mode": config.mode,
            "seed": config.seed,
        },
    }


def progress_line(row: dict[str, Any], total: int, rejections: int, started: float) -> str:
    step = int(row.get("step", 0))
    width = 24
    done = min(width, int(width * step / max(total, 1)))
    gap = row.get("version_gap_mean")
    reward = row.get("reward_mean")
    return (
        f"[{'#' * done}{'.' * (width - done)}] step {step:>3}/{total}"
        f"  reward {reward if reward is None else f'{reward:.3f}'}"
        f"  gap {gap if gap is None else f'{gap:.2f}'}"
        f"  drops {row.get('drops_cumulative', 0)}  rejections {rejections}"
        f"  {time.monotonic() - started:6.0f}s"
    )


def run(args: argparse.Namespace) -> int:
    run_id = time.strftime("%Y%m%d-%H%M%S")
    config = StackConfig(
        run_dir=args.runs_dir / run_id,
        steps=args.steps,
        keep_versions=args.keep_versions,
        max_preempts=args.max_preempts,
        collectors=args.collectors,
        batch_groups=args.batch_groups,
        group_size=args.group_size,
        max_concurrent_groups=args.concurrent_groups,
        mode=args.mode,
        seed=args.seed,
    )
    print(f"rein demo: run {run_id} -> {config.run_dir}", flush=True)
    print("starting Kafka, Redis, trainer, engine, proxy, broadcaster, collectors, rollout ...", flush=True)
    started = time.monotonic()
    local: LocalStack | None = None
    rows: list[dict[str, Any]] = []
    rejections = 0
    code = 0
    try:
        local = start(config)
        versions = ", ".join(f"{k} {v}" for k, v in local.infra.versions.items())
        print(f"up in {time.monotonic() - started:.0f}s ({versions}); logs in {config.run_dir / 'logs'}", flush=True)
        deadline = started + args.timeout_min * 60
        shown = 0
        while True:
            rows = rows_so_far(local.trainer_metrics)
            if len(rows) > shown:
                rejections = proxy_rejections(local.urls["proxy"])
                for row in rows[shown:]:
                    print(progress_line(row, config.steps, rejections, started), flush=True)
                shown = len(rows)
            if config.steps and len(rows) >= config.steps:
                break
            dead = [s for s in local.stack.dead() if s.name != "trainer"]
            trainer_gone = any(s.name == "trainer" for s in local.stack.dead())
            if dead or (trainer_gone and len(rows) < config.steps):
                who = dead[0] if dead else next(s for s in local.stack.services if s.name == "trainer")
                print(f"error: {who.name} exited early; see {who.log_path}", file=sys.stderr)
                code = 1
                break
            if time.monotonic() > deadline:
                print(f"error: timed out after {args.timeout_min} min at step {len(rows)}", file=sys.stderr)
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process ...", file=sys.stderr)
        code = 130
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    finally:
        if local is not None:
            rejections = max(rejections, proxy_rejections(local.urls["proxy"]))
            local.stop()
            print("stopped every process the demo started", flush=True)
    wall = time.monotonic() - started
    if rows:
        write_outputs(config, rows, rejections, wall)
    return code


def write_outputs(config: StackConfig, rows: list[dict[str, Any]], rejections: int, wall_s: float) -> None:
    summary = summarize(rows, rejections, wall_s, config)
    (config.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    png = plot_run(rows, config.run_dir / "plot.png", title=f"rein demo {config.run_dir.name}")
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "steps",
                    "reward_start",
                    "reward_end",
                    "learned",
                    "version_gap_mean",
                    "dropped_groups",
                    "rejected_sessions",
                    "wall_s",
                )
            }
        )
    )
    print(f"summary: {config.run_dir / 'summary.json'}\nplot:    {png}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM (a CI timeout, `kill`) stops every child exactly like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
