"""``make demo``: the whole pipeline learning a task on CPU, with progress.

Starts Kafka, Redis and every service as local processes (``ops.local.stack``), runs
trainer steps with ``keep_versions=2``, partial rollout on and ``max_preempts=2``
until a step count (and, for a real model, a wall-time budget) is reached, shows one
progress line per step (reward, version gap, drops, rejections; a batch the trainer
skipped for lack of gradient gets a line saying so), stops every process
it started (also on Ctrl-C), and writes ``runs/<id>/summary.json`` and ``runs/<id>/plot.png``.

``--model`` picks what trains: ``tiny`` (default; the built-in policy on number guessing),
``smollm2`` (SmolLM2-135M-Instruct, converted once by ``deploy/smollm2.sh``, on the
arithmetic task) or a path to a Hugging Face directory or a ``.gguf`` file (arithmetic too).
Each has its own defaults (``ops.demo_presets.PRESETS``); every flag overrides them. The stack's flags
are ``rein up``'s too (``ops.stack_flags``).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ops.demo_metrics import EngineUsage, ToolCallSeries, proxy_rejections, proxy_tool_calls, scrape
from ops.demo_presets import PRESETS
from ops.demo_summary import progress_line, summarize, write_outputs
from ops.local.launcher import LaunchError
from ops.local.stack import LocalStack, start
from ops.report import MetricsTail, optimizer_steps, rows_so_far
from ops.stack_flags import add_stack_flags, apply_preset, resolve_model, stack_config
from services.rollout.tasks import TASKS

PROXY_READ_S = 1.0
"""Most often the progress loop reads the proxy's ``/metrics`` (its rejections on the progress lines, its
tool-call counts): the proxy renders every metric for each read, and a step comes several times a second."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make demo", description=__doc__.splitlines()[0] if __doc__ else None)
    add_stack_flags(p)
    p.add_argument("--steps", type=int, help="trainer steps to run at most (tiny: 2000, HF: 500)")
    p.add_argument(
        "--minutes",
        type=float,
        help="stop training after this many minutes once the stack is up (tiny: 8, HF: 20; 0 = steps only)",
    )
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument(
        "--timeout-min",
        type=float,
        help="give up (an error) after this many minutes (default: the budget + 15, at least 30)",
    )
    args = p.parse_args(argv)
    apply_preset(args)
    if args.timeout_min is None:
        args.timeout_min = max(30.0, args.minutes + 15.0)
    return args


def offers_tools(task: str) -> bool:
    """Whether the task's episodes offer tools (its run then reports tool calls)."""
    return bool(TASKS[task]().episode().tools) if task in TASKS else False


def run(args: argparse.Namespace) -> int:
    run_id = time.strftime("%Y%m%d-%H%M%S")
    try:
        model = resolve_model(args.model)
    except (ValueError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    config = stack_config(args, model, args.runs_dir / run_id)
    task, steps_cap = config.setting("rollout", "task"), config.setting("trainer", "max_steps")
    print(f"rein demo: run {run_id} -> {config.run_dir} (model {model}, task {task})", flush=True)
    preset = PRESETS["tiny" if args.model == "tiny" else "hf"]
    print(f"mode {config.mode}: " + (preset.mode_why if config.mode == preset.flags["mode"] else "--mode"), flush=True)
    print("starting Kafka, Redis, trainer, engine, proxy, broadcaster, collectors, rollout ...", flush=True)
    started = time.monotonic()
    local: LocalStack | None = None
    rows: list[dict[str, Any]] = []
    rejections = 0
    code = 0
    stopped_by = "steps"
    usage = EngineUsage()
    up_at: float | None = None
    up_ts: float | None = None
    tool_calls: dict[str, Any] | None = None
    calls = ToolCallSeries()
    proxy_read_at = -PROXY_READ_S
    try:
        local = start(config)
        up_at, up_ts = time.monotonic(), time.time()
        versions = ", ".join(f"{k} {v}" for k, v in local.infra.versions.items())
        print(f"up in {up_at - started:.0f}s ({versions}); logs in {config.run_dir / 'logs'}", flush=True)
        if args.minutes:
            print(f"training for at most {steps_cap} steps or {args.minutes:g} minutes", flush=True)
        deadline = started + args.timeout_min * 60
        budget = (up_at, args.minutes * 60) if args.minutes else None
        shown = 0
        metrics = MetricsTail(local.trainer_metrics)
        while True:
            rows = metrics.read()
            if len(rows) > shown:
                if time.monotonic() - proxy_read_at >= PROXY_READ_S:
                    proxy_read_at = time.monotonic()
                    if (text := scrape(local.urls["proxy"])) is not None:
                        rejections = proxy_rejections(text)
                        calls.sample(len(rows), text)
                for row in rows[shown:]:
                    print(progress_line(row, steps_cap, rejections, started, budget), flush=True)
                shown = len(rows)
            steps = len(optimizer_steps(rows))
            if steps_cap and steps >= steps_cap:
                break
            if budget is not None and time.monotonic() - budget[0] >= budget[1]:
                stopped_by = "time"
                print(f"time budget of {args.minutes:g} minutes reached at step {steps}", flush=True)
                break
            dead = [s for s in local.stack.dead() if s.name != "trainer"]
            trainer_gone = any(s.name == "trainer" for s in local.stack.dead())
            if dead or (trainer_gone and steps < steps_cap):
                who = dead[0] if dead else next(s for s in local.stack.services if s.name == "trainer")
                print(f"error: {who.name} exited early; see {who.log_path}", file=sys.stderr)
                code = 1
                break
            if time.monotonic() > deadline:
                print(f"error: timed out after {args.timeout_min} min at step {steps}", file=sys.stderr)
                code = 1
                break
            if (text := scrape(local.urls["engine"])) is not None:
                usage.sample(text)
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process ...", file=sys.stderr)
        code = 130
        stopped_by = "interrupt"
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    finally:
        train_wall = None if up_at is None else time.monotonic() - up_at
        if local is not None:
            if (text := scrape(local.urls["proxy"])) is not None:
                rejections = max(rejections, proxy_rejections(text))
                tool_calls = proxy_tool_calls(text)
                if tool_calls["well_formed_share"] is None and not offers_tools(task):
                    tool_calls = None  # a task without tools whose replies never held call markup: nothing to say
            local.stop()
            print("stopped every process the demo started", flush=True)
    wall = time.monotonic() - started
    rows = rows_so_far(config.run_dir / "trainer" / "metrics.jsonl") or rows  # a stopping trainer adds its last step
    if rows or stopped_by == "time":  # a budget with no step in it is a result too (censored), not a failure
        if tool_calls is not None:
            calls.annotate(rows)
            tool_calls["series"] = calls.samples
        write_outputs(config, rows, summarize(
            rows, rejections, wall, config, stopped_by=stopped_by, usage=usage, train_wall_s=train_wall,
            train_started_ts=up_ts, tool_calls=tool_calls,
        ))
    return code


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM (a CI timeout, `kill`) stops every child exactly like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
