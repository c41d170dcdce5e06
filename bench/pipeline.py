"""Sync vs async throughput of the whole pipeline, side by side in one run.

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
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from shared.stack import StackConfig, start

_IN_FLIGHT = re.compile(r"^rein_rollout_groups_in_flight\s+([0-9.eE+-]+)$", re.M)


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def run_mode(mode: str, steps: int, root: Path, seed: int, timeout_s: float) -> dict[str, Any]:
    config = StackConfig(
        run_dir=root / mode,
        steps=steps,
        mode=mode,
        seed=seed,
        keep_versions=2,
        max_preempts=2,
        collectors=1,
        batch_groups=8,
        group_size=8,
        max_concurrent_groups=16 if mode == "async" else 8,
    )
    local = start(config)
    samples: list[float] = []
    stop = threading.Event()

    def sample_rollout() -> None:
        with httpx.Client(timeout=2.0) as client:
            while not stop.is_set():
                try:
                    found = _IN_FLIGHT.findall(client.get(f"{local.urls['rollout']}/metrics").text)
                    if found and _rows(local.trainer_metrics):
                        samples.append(float(found[0]))
                except httpx.HTTPError:
                    pass
                stop.wait(0.25)

    sampler = threading.Thread(target=sample_rollout, daemon=True)
    sampler.start()
    try:
        deadline = time.monotonic() + timeout_s
        while len(_rows(local.trainer_metrics)) < steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: only {len(_rows(local.trainer_metrics))}/{steps} steps in {timeout_s}s")
            dead = [s.name for s in local.stack.dead() if s.name != "trainer"]
            if dead:
                raise RuntimeError(f"{mode}: {dead} died; logs in {config.run_dir / 'logs'}")
            time.sleep(0.5)
    finally:
        stop.set()
        sampler.join(5)
        local.stop()
    rows = _rows(local.trainer_metrics)[:steps]
    # From the end of step 1 to the end of step N: start-up and the first rollout are excluded.
    wall = float(rows[-1]["ts"]) - float(rows[0]["ts"])
    tokens = sum(int(r["trained_tokens"]) for r in rows[1:])
    busy = sum(float(r["step_time_s"]) + float(r.get("fetch_time_s") or 0.0) for r in rows[1:])
    return {
        "mode": mode,
        "steps": len(rows),
        "wall_s": wall,
        "trained_tokens": tokens,
        "trained_tokens_per_s": tokens / wall if wall > 0 else None,
        "trainer_idle_fraction": 1 - busy / wall if wall > 0 else None,
        "rollout_idle_fraction": sum(1 for v in samples if v == 0) / len(samples) if samples else None,
        "reward_last5": sum(float(r["reward_mean"]) for r in rows[-5:]) / min(5, len(rows)),
        "version_gap_mean": sum(float(r.get("version_gap_mean") or 0) for r in rows) / len(rows),
        "drops": rows[-1].get("drops_cumulative"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", type=Path, default=Path("bench/pipeline.json"))
    args = p.parse_args()
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


if __name__ == "__main__":
    raise SystemExit(main())
