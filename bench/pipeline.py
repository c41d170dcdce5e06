"""Sync vs async throughput of the whole pipeline, side by side in one run (and other comparisons).

Runs the local stack (the processes of ``make demo``) once in sync mode (the
rollout runner dispatches one batch of groups, then waits for the weight update
before the next: no rollout while the trainer trains) and once in async mode
(``keep_versions=2``, partial rollout, ``max_preempts=2``), same task, model,
seed and step count, and reports:

* trained tokens per second (trainer step 1 .. N wall time),
* trainer idle fraction (1 - time inside optimizer steps / wall time),
* rollout idle fraction (share of 0.25 s samples with no group in flight).

Prints a table and writes JSON. Usage::

    $(bash deploy/venv.sh --path)/bin/python bench/pipeline.py --steps 20 --out bench/pipeline.json

``--compare demo``: the demo configuration (``make demo``'s tiny preset) for ``--steps`` steps
against the in-process reference (``bench/inprocess.py``: same policy, task, batch, sampler and
optimizer, no HTTP, Kafka or Redis), run just before and just after it in the same invocation
(the ratio uses the mean of the two). Reports trained episodes/s of each and their ratio, the CPU
time (utime + stime, ``/proc/<pid>/stat``) of every service process, Kafka and Redis over the
measured interval with each one's share of their sum, and the proxy's pause stall per weight
update (from its ``paused``/``resumed`` log lines: admission closed at ``paused.timestamp -
waited_s``, reopened at ``resumed``)::

    $(bash deploy/venv.sh --path)/bin/python bench/pipeline.py --compare demo --steps 20 \\
        --out /tmp/rein-bench-demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import inprocess
from bench.procstat import cpu_split, service_pids, snapshot
from bench.token_accounting import token_accounting
from bench.update_logs import pause_stalls, stall_summary, update_phases
from ops.demo import parse_args as demo_args
from ops.local.stack import StackConfig, start
from ops.report import rows_so_far
from ops.stack_flags import stack_config

_IN_FLIGHT = re.compile(r"^rein_rollout_groups_in_flight\s+([0-9.eE+-]+)$", re.M)


def config_for(name: str, steps: int, root: Path, seed: int) -> StackConfig:
    """The compared set-ups. ``controls``/``none`` run under high asynchrony (48 groups in flight
    for batches of 8, two-token replies, a slower engine step) so that staleness actually occurs; ``learn-*`` are
    the demo's learning regime (one-token replies) under the same asynchrony: a reply cannot span versions, so of
    the three controls only the window acts."""

    def setup(mode: Literal["async", "sync"], keep: int, preempts: int | None, in_flight: int, *, high: bool = False,
              mask: bool = True, pacing: str = "window") -> StackConfig:
        return StackConfig(
            run_dir=root / f"{name}-s{seed}", seed=seed, collectors=1, batch_groups=8, mode=mode,
            services={
                "trainer": {"max_steps": steps, "nonlast_version_tokens": "mask" if mask else "weight"},
                "collector": {"keep_versions": keep}, "proxy": {"max_preempts": preempts},
                "rollout": {"group_size": 8, "max_concurrent_groups": in_flight, "max_tokens": 2 if high else 1,
                            "pacing": pacing},
                "engine": {"step_delay_s": 0.002 if high else 0.0},
            },
        )

    if name == "sync":
        return setup("sync", 2, 2, 8)
    if name == "async":
        return setup("async", 2, 2, 16)
    if name in ("controls", "learn-controls"):
        return setup("async", 1, 1, 48, high=name == "controls")
    if name in ("none", "learn-none"):
        return setup("async", 0, None, 48, high=name == "none", mask=False)
    if name.startswith("cost-"):  # cost-k<keep>-p<preempts>-<pacing>
        _, k, p, pacing = name.split("-")
        return setup("async", int(k[1:]), int(p[1:]), 48, high=True, pacing=pacing)
    raise ValueError(f"unknown set-up {name!r}")


def run_mode(name: str, steps: int, root: Path, seed: int, timeout_s: float) -> dict[str, Any]:
    config = config_for(name, steps, root, seed)
    mode = name
    local = start(config)
    samples: list[float] = []
    stop = threading.Event()

    def sample_rollout() -> None:
        with httpx.Client(timeout=2.0) as client:
            while not stop.is_set():
                try:
                    found = _IN_FLIGHT.findall(client.get(f"{local.urls['rollout']}/metrics").text)
                    if found and rows_so_far(local.trainer_metrics):
                        samples.append(float(found[0]))
                except httpx.HTTPError:
                    pass
                stop.wait(0.25)

    sampler = threading.Thread(target=sample_rollout, daemon=True)
    sampler.start()
    try:
        deadline = time.monotonic() + timeout_s
        while len(rows_so_far(local.trainer_metrics)) < steps:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{mode}: only {len(rows_so_far(local.trainer_metrics))}/{steps} steps in {timeout_s}s"
                )
            dead = [s.name for s in local.stack.dead() if s.name != "trainer"]
            if dead:
                raise RuntimeError(f"{mode}: {dead} died; logs in {config.run_dir / 'logs'}")
            time.sleep(0.5)
        accounting = token_accounting(local, steps) if name.startswith("cost-") else {}
    finally:
        stop.set()
        sampler.join(5)
        local.stop()
    rows = rows_so_far(local.trainer_metrics)[:steps]
    # From the end of step 1 to the end of step N: start-up and the first rollout are excluded.
    wall = float(rows[-1]["ts"]) - float(rows[0]["ts"])
    tokens = sum(int(r["trained_tokens"]) for r in rows[1:])
    busy = sum(float(r["step_time_s"]) + float(r.get("fetch_time_s") or 0.0) for r in rows[1:])
    return {
        **accounting,
        "mode": mode,
        "seed": seed,
        "logprob_abs_diff_mean": sum(float(r["train_rollout_logprob_abs_diff"] or 0) for r in rows[1:])
        / max(1, len(rows) - 1),
        "masked_token_fraction": sum(float(r["masked_token_fraction"] or 0) for r in rows) / len(rows),
        "steps": len(rows),
        "wall_s": wall,
        "trained_tokens": tokens,
        "trained_tokens_per_s": tokens / wall if wall > 0 else None,
        "trainer_idle_fraction": 1 - busy / wall if wall > 0 else None,
        "rollout_idle_fraction": sum(1 for v in samples if v == 0) / len(samples) if samples else None,
        "reward_last5": sum(float(r["reward_mean"]) for r in rows[-5:]) / min(5, len(rows)),
        "reward_last20": sum(float(r["reward_mean"]) for r in rows[-20:]) / min(20, len(rows)),
        "rewards": [float(r["reward_mean"]) for r in rows],
        "version_gap_mean": sum(float(r.get("version_gap_mean") or 0) for r in rows) / len(rows),
        "drops": rows[-1].get("drops_cumulative"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", type=Path, default=Path("bench/pipeline.json"))
    p.add_argument(
        "--compare",
        choices=["sync-async", "controls", "learning", "cost", "demo"],
        default="sync-async",
        help="sync vs async throughput, or async with staleness controls vs none under high asynchrony",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (controls comparison)")
    p.add_argument("--keep", type=int, nargs="+", default=None, help="--compare cost: keep_versions values")
    p.add_argument("--preempts", type=int, nargs="+", default=None, help="--compare cost: max_preempts values")
    p.add_argument("--demo-flag", action="append", default=[],
                   help="a flag of make demo for --compare demo, e.g. --demo-flag=--concurrent-groups=8")
    p.add_argument("--keep-logs", type=Path, default=None,
                   help="--compare demo: copy the stack's logs here before its run directory is removed")
    args = p.parse_args()
    if args.compare in ("controls", "learning"):
        return compare_controls(args)
    if args.compare == "cost":
        return compare_cost(args)
    if args.compare == "demo":
        return compare_demo(args)
    with tempfile.TemporaryDirectory(prefix="rein-bench-") as tmp:
        results = [run_mode(mode, args.steps, Path(tmp), args.seed, args.timeout_s) for mode in ("sync", "async")]
    sync, asyn = results
    ratio = (asyn["trained_tokens_per_s"] or 0) / (sync["trained_tokens_per_s"] or 1)
    print(f"{'mode':<6} {'steps':>5} {'wall s':>7} {'tok/s':>7} {'trainer idle':>12} {'rollout idle':>12} {'gap':>5}")
    for r in results:
        print(
            f"{r['mode']:<6} {r['steps']:>5} {r['wall_s']:>7.1f} {r['trained_tokens_per_s']:>7.1f} "
            f"{r['trainer_idle_fraction']:>12.2f} {(r['rollout_idle_fraction'] or 0):>12.2f} "
            f"{r['version_gap_mean']:>5.2f}"
        )
    print(f"async / sync trained tokens per second: {ratio:.2f}x")
    args.out.write_text(json.dumps({"results": results, "async_over_sync": ratio}, indent=2))
    return 0


def compare_controls(args: argparse.Namespace) -> int:
    seeds = args.seeds or [args.seed]
    results = []
    with tempfile.TemporaryDirectory(prefix="rein-bench-") as tmp:
        for seed in seeds:
            for name in ("controls", "none"):
                name = name if args.compare == "controls" else f"learn-{name}"
                results.append(run_mode(name, args.steps, Path(tmp), seed, args.timeout_s))
                args.out.write_text(json.dumps({"results": results, "complete": False}, indent=2))  # so far
    print(
        f"{'set-up':<14} {'seed':>4} {'|logprob diff|':>14} {'gap':>5} {'reward last5':>12} {'last20':>6} "
        f"{'drops':>5} {'masked':>6}"
    )
    for r in results:
        print(
            f"{r['mode']:<14} {r['seed']:>4} {r['logprob_abs_diff_mean']:>14.4f} {r['version_gap_mean']:>5.2f} "
            f"{r['reward_last5']:>12.3f} {r['reward_last20']:>6.3f} {r['drops'] or 0:>5} "
            f"{r['masked_token_fraction']:>6.2f}"
        )
    args.out.write_text(json.dumps({"results": results}, indent=2))
    return 0


def compare_cost(args: argparse.Namespace) -> int:
    """Share of generated tokens never trained, for keep_versions x max_preempts (1/2/4 x 0/1/2 unless
    --keep/--preempts narrow it), each cell with the runner's pacing on (window) and off, side by side."""
    results = []
    with tempfile.TemporaryDirectory(prefix="rein-bench-") as tmp:
        for keep in args.keep or (1, 2, 4):
            for preempts in args.preempts or (0, 1, 2):
                for pacing in ("window", "off"):
                    name = f"cost-k{keep}-p{preempts}-{pacing}"
                    results.append(run_mode(name, args.steps, Path(tmp), args.seed, args.timeout_s))
                    r = results[-1]
                    print(
                        f"keep {keep} preempts {preempts} pacing {pacing:<6}: untrained {r['untrained_fraction']:.3f} "
                        f"(by staleness {r['stale_fraction']:.3f}; window {r['tokens_dropped_stale']}, "
                        f"no signal {r['tokens_no_signal']}, failed {r['tokens_failed']}, masked "
                        f"{r['tokens_masked']}, generated {r['tokens_generated']}), trained tok/s "
                        f"{r['trained_tokens_per_s']:.1f}",
                        flush=True,
                    )
                    args.out.write_text(json.dumps({"results": results}, indent=2))
    return 0


# --------------------------------------------------------------------------- --compare demo

def group_cpu(split: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The split with the collector replicas summed as ``collectors`` (the issue's categories)."""
    out: dict[str, dict[str, float]] = {}
    for name, row in split.items():
        key = "collectors" if name.startswith("collector-") else name
        acc = out.setdefault(key, {"cpu_s": 0.0, "share": 0.0})
        acc["cpu_s"] = round(acc["cpu_s"] + row["cpu_s"], 3)
        acc["share"] = round(acc["share"] + row["share"], 4)
    return out


def demo_config(steps: int, seed: int, run_dir: Path, demo_flags: Sequence[str] = ()) -> StackConfig:
    """What ``make demo`` starts for the tiny policy (its preset and flag defaults, or ``demo_flags``),
    bounded to ``steps``."""
    return stack_config(demo_args(["--steps", str(steps), "--seed", str(seed), *demo_flags]), "tiny", run_dir)


def run_demo(
    steps: int, seed: int, root: Path, timeout_s: float, demo_flags: Sequence[str] = (), keep_logs: Path | None = None
) -> dict[str, Any]:
    """The demo stack for ``steps`` steps: throughput and CPU split from the end of step 1 to the end of
    step N, and the stall of every weight update of the run (v1..vN; it waits, bounded, for vN to be served)."""
    config = demo_config(steps, seed, root / "demo", demo_flags)
    local = start(config)
    before: dict[str, float] | None = None
    after: dict[str, float] = {}
    try:
        pids = service_pids(local)
        deadline = time.monotonic() + timeout_s
        while True:
            n = len(rows_so_far(local.trainer_metrics))
            if before is None and n >= 1:
                before = snapshot(pids)
                before["bench"] = _self_cpu()
            if n >= steps:
                after = snapshot(pids)
                after["bench"] = _self_cpu()
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"demo: only {n}/{steps} steps in {timeout_s}s")
            dead = [s.name for s in local.stack.dead() if s.name != "trainer"]
            if dead:
                raise RuntimeError(f"demo: {dead} died; logs in {config.run_dir / 'logs'}")
            time.sleep(0.1)
        proxy_log = config.run_dir / "logs" / "proxy.log"
        served = _wait_served(proxy_log, f"v{steps}", timeout_s=30)
    finally:
        local.stop()
        if keep_logs is not None:
            shutil.copytree(config.run_dir / "logs", keep_logs, dirs_exist_ok=True)
    assert before is not None
    rows = rows_so_far(local.trainer_metrics)[:steps]
    ts = [float(r["ts"]) for r in rows]
    bench_cpu = after.pop("bench") - before.pop("bench")
    split = cpu_split(before, after)
    stalls = pause_stalls(proxy_log.read_text(errors="replace").splitlines())
    rewards = [float(r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    return {
        "steps": len(rows),
        "wall_s": ts[-1] - ts[0] if len(ts) > 1 else None,
        "episodes": sum(int(r["trajectories"]) for r in rows[1:]),
        "episodes_per_s": inprocess.episodes_per_s(rows, ts),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "cpu": split,
        "cpu_grouped": group_cpu(split),
        "cpu_busy_s": round(sum(v["cpu_s"] for v in split.values()), 3),
        "bench_cpu_s": round(bench_cpu, 3),
        "stall": stall_summary(stalls),
        "stalls": stalls,
        "update_phases": update_phases(
            (config.run_dir / "logs" / "broadcaster.log").read_text(errors="replace").splitlines()),
        "last_version_served": served,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()},
    }


def _wait_served(proxy_log: Path, version: str, timeout_s: float) -> bool:
    """Until the proxy resumed on ``version`` (so every update of the run is in its log), bounded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s["version"] == version for s in pause_stalls(proxy_log.read_text(errors="replace").splitlines())):
            return True
        time.sleep(0.2)
    return False


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def compare_demo(args: argparse.Namespace) -> int:
    """The reference runs just before and just after the pipeline (a shared machine's load drifts);
    the ratio uses the mean of its two rates."""
    before = inprocess.run(steps=args.steps, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="rein-bench-") as tmp:
        demo = run_demo(args.steps, args.seed, Path(tmp), args.timeout_s, args.demo_flag, args.keep_logs)
    after = inprocess.run(steps=args.steps, seed=args.seed)
    rates = [r["episodes_per_s"] for r in (before, after) if r["episodes_per_s"]]
    reference = {k: v for k, v in before.items() if k != "rows"}
    reference["episodes_per_s_before_after"] = [before["episodes_per_s"], after["episodes_per_s"]]
    reference["episodes_per_s"] = statistics.mean(rates) if rates else None
    ratio = (demo["episodes_per_s"] or 0) / reference["episodes_per_s"] if reference["episodes_per_s"] else None
    print(f"{'':12} {'steps':>5} {'wall s':>7} {'episodes/s':>10} {'reward 1st':>10} {'reward last':>11}")
    print(f"{'pipeline':12} {demo['steps']:>5} {demo['wall_s'] or 0:>7.1f} {demo['episodes_per_s'] or 0:>10.1f} "
          f"{demo['reward_first'] or 0:>10.3f} {demo['reward_last'] or 0:>11.3f}")
    print(f"{'in-process':12} {reference['steps']:>5} {reference['wall_s']:>7.1f} "
          f"{reference['episodes_per_s'] or 0:>10.1f} {reference['reward_first'] or 0:>10.3f} "
          f"{reference['reward_last'] or 0:>11.3f}")
    print("in-process episodes/s before / after the pipeline: "
          + " / ".join(f"{r:.1f}" for r in reference["episodes_per_s_before_after"] if r is not None))
    print(f"pipeline / in-process episodes/s: {ratio:.4f} (1/{1 / ratio:.0f})" if ratio else "ratio: n/a")
    print(f"\nCPU over steps 2..{demo['steps']} ({demo['cpu_busy_s']:.1f} CPU-s busy in the stack; "
          f"this script {demo['bench_cpu_s']:.1f} CPU-s)")
    for name, row in sorted(demo["cpu_grouped"].items(), key=lambda kv: -kv[1]["cpu_s"]):
        print(f"  {name:<12} {row['cpu_s']:>7.1f} s {100 * row['share']:>5.1f} %")
    st = demo["stall"]
    print(f"\npause stall per weight update ({st['updates']} updates): p50 {st['p50_ms']} ms, "
          f"p99 {st['p99_ms']} ms, max {st['max_ms']} ms")
    if demo["update_phases"]:
        print("as the broadcaster saw it, p50 / p99 ms: " + ", ".join(
            f"{k} {v['p50_ms']} / {v['p99_ms']}" for k, v in demo["update_phases"].items()))
    out = {"pipeline": demo, "inprocess": reference, "pipeline_over_inprocess": ratio}
    args.out.write_text(json.dumps(out, indent=2, default=str))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
