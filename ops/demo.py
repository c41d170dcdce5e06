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
Each has its own defaults (``ops.demo_presets.PRESETS``); every flag overrides them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from ops.args import RegistryChoices, max_preempts_arg
from ops.demo_metrics import EngineUsage, ToolCallSeries, proxy_rejections, proxy_tool_calls
from ops.demo_presets import PRESETS
from ops.demo_summary import progress_line, summarize, write_outputs
from ops.local.launcher import LaunchError
from ops.local.stack import LocalStack, StackConfig, start
from ops.report import MetricsTail, optimizer_steps, rows_so_far
from services.rollout.tasks import TASKS

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = "smollm2"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make demo", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--model", default="tiny", help="tiny (default), smollm2, or a path to a Hugging Face directory or a .gguf file"
    )
    p.add_argument("--steps", type=int, help="trainer steps to run at most (tiny: 2000, HF: 500)")
    p.add_argument(
        "--minutes",
        type=float,
        help="stop training after this many minutes once the stack is up (tiny: 8, HF: 20; 0 = steps only)",
    )
    p.add_argument("--keep-versions", type=int, default=2, help="the collector's window (0 = off)")
    p.add_argument("--max-preempts", type=max_preempts_arg, default=2, help="the proxy's span cap (none = no cap)")
    p.add_argument("--pacing", choices=["window", "off"], default="window",
                   help="async mode: start prompts only while the window can still train them (docs/task.md)")
    p.add_argument("--stale-groups", choices=["drop", "withhold"], default="drop",
                   help="the collector's groups with members outside the window: drop whole or withhold those members")
    p.add_argument("--correction", choices=RegistryChoices("services.trainer.corrections", "CORRECTIONS"),
                   default="none", metavar="NAME",
                   help="the trainer's off-policy correction (REIN_OFFPOLICY_CORRECTION): %(choices)s")
    p.add_argument("--nonlast-version-tokens", choices=["mask", "weight"], default="mask",
                   help="the trainer's treatment of a trajectory's tokens from older versions")
    p.add_argument("--collectors", type=int, help="collector replicas (tiny: 2, HF: 1)")
    p.add_argument("--batch-groups", type=int, help="GRPO groups per training batch (tiny: 4, HF: 2)")
    p.add_argument("--group-size", type=int, help="episodes per group (tiny: 8, HF: 4)")
    p.add_argument("--concurrent-groups", type=int, help="groups in flight (tiny: 8, HF: 4)")
    p.add_argument("--task", choices=list(TASKS),
                   help="rollout task (tiny: guess_number; HF: arithmetic, or calculator, which needs a tool call)")
    p.add_argument("--max-tokens", type=int, help="output budget of each reply (tiny: the runner's 1, HF: 48)")
    p.add_argument("--temperature", type=float, help="sampling temperature of every reply (the runner's 1.0)")
    p.add_argument("--agent-command", type=shlex.split,
                   help="a black-box agent run per episode instead of rein's own loop, as a shell would split it; "
                        "{prompt}, {base_url} and {api_key} are replaced (REIN_AGENT_COMMAND, docs/agents.md)")
    p.add_argument("--env-time", type=float, metavar="MEDIAN_S",
                   help="seconds each environment step (an answer, the grade) waits, median: a tool's or a grader's "
                        "time, spent without a core (REIN_ENV_TIME_MEDIAN_S; default none)")
    p.add_argument("--env-time-sigma", type=float, metavar="SIGMA",
                   help="log-normal sigma of that wait (REIN_ENV_TIME_SIGMA; default 0: always the median)")
    p.add_argument("--lr", type=float, help="trainer learning rate (tiny: the trainer's 1e-3, HF: 2e-5)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (tiny: the trainer's 0.01, HF: 0)")
    p.add_argument("--epochs", type=int, help="optimizer steps per batch (REIN_EPOCHS; the trainer's 1)")
    p.add_argument("--keep-checkpoints", type=int, help="newest trainer steps kept on disk (tiny: 0 = all, HF: 2)")
    p.add_argument("--mode", choices=["async", "sync"],
                   help="async (tiny's default) or sync (HF's: it learned faster on SmolLM2, docs/benchmarks.md)")
    p.add_argument("--no-signal-groups", choices=["drop", "keep"],
                   help="the collectors' groups whose rewards are all equal (default: drop in async mode, keep in "
                        "sync mode; a sync wave tops itself up for each one dropped)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch threads of the trainer and the engine (default 1: a core each; in sync mode one "
                        "phase runs at a time, so each may take every core in turn)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument(
        "--timeout-min",
        type=float,
        help="give up (an error) after this many minutes (default: the budget + 15, at least 30)",
    )
    args = p.parse_args(argv)
    preset = PRESETS["tiny" if args.model == "tiny" else "hf"]
    for f in fields(preset):
        if getattr(args, f.name) is None:
            setattr(args, f.name, getattr(preset, f.name))
    if args.timeout_min is None:
        args.timeout_min = max(30.0, args.minutes + 15.0)
    return args



def resolve_model(spec: str) -> str:
    """``REIN_MODEL`` for ``--model``: ``smollm2`` is converted once by ``deploy/smollm2.sh`` (which
    prints its directory); ``tiny`` and paths pass through (the model layer converts a GGUF itself)."""
    if spec != SMOLLM2:
        if spec != "tiny" and not Path(spec).expanduser().exists():
            raise ValueError(f"--model {spec!r}: expected tiny, {SMOLLM2}, or an existing HF directory or .gguf file")
        return spec if spec == "tiny" else str(Path(spec).expanduser().resolve())
    print("preparing SmolLM2-135M-Instruct (deploy/smollm2.sh: download and convert once) ...", flush=True)
    proc = subprocess.run(
        ["bash", str(REPO / "deploy" / "smollm2.sh")], stdout=subprocess.PIPE, text=True, timeout=1800, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ValueError(f"deploy/smollm2.sh failed (exit {proc.returncode}); see its messages above")
    return lines[-1]


def offers_tools(task: str) -> bool:
    """Whether the task's episodes offer tools (its run then reports tool calls)."""
    return bool(TASKS[task]().episode().tools) if task in TASKS else False


def stack_config(args: argparse.Namespace, model: str, run_dir: Path) -> StackConfig:
    """What the demo starts for parsed ``args`` and a resolved ``model`` (``resolve_model``)."""
    hf = model != "tiny"
    return StackConfig(
        run_dir=run_dir,
        steps=args.steps,
        keep_versions=args.keep_versions,
        max_preempts=args.max_preempts,
        pacing=args.pacing,
        offpolicy_correction=args.correction,
        stale_groups=args.stale_groups,
        mask_nonlast_version=args.nonlast_version_tokens == "mask",
        collectors=args.collectors,
        batch_groups=args.batch_groups,
        group_size=args.group_size,
        max_concurrent_groups=args.concurrent_groups,
        mode=args.mode,
        seed=args.seed,
        torch_threads=args.torch_threads,
        no_signal_groups=args.no_signal_groups,
        model=model,
        task=args.task,
        max_tokens=args.max_tokens,
        lr=args.lr,
        weight_decay=args.weight_decay,
        epochs=args.epochs,
        keep_checkpoints=args.keep_checkpoints,
        startup_timeout_s=600.0 if hf else 120.0,
        stop_timeout_s=120.0 if hf else 20.0,
        extra_env={**({"trainer": {"REIN_STOP_TIMEOUT_S": "110"}} if hf else {}),  # its last checkpoint: ~0.5 GB
                   "rollout": {
            **({} if args.temperature is None else {"REIN_TEMPERATURE": str(args.temperature)}),
            **({"REIN_AGENT_COMMAND": json.dumps(args.agent_command)} if args.agent_command else {}),
            **({} if args.env_time is None else {"REIN_ENV_TIME_MEDIAN_S": str(args.env_time)}),
            **({} if args.env_time_sigma is None else {"REIN_ENV_TIME_SIGMA": str(args.env_time_sigma)}),
        }},
    )


def run(args: argparse.Namespace) -> int:
    run_id = time.strftime("%Y%m%d-%H%M%S")
    try:
        model = resolve_model(args.model)
    except (ValueError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    config = stack_config(args, model, args.runs_dir / run_id)
    print(f"rein demo: run {run_id} -> {config.run_dir} (model {model}, task {config.task})", flush=True)
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
    calls = ToolCallSeries("")
    try:
        local = start(config)
        calls.url = local.urls["proxy"]
        up_at, up_ts = time.monotonic(), time.time()
        versions = ", ".join(f"{k} {v}" for k, v in local.infra.versions.items())
        print(f"up in {up_at - started:.0f}s ({versions}); logs in {config.run_dir / 'logs'}", flush=True)
        if args.minutes:
            print(f"training for at most {config.steps} steps or {args.minutes:g} minutes", flush=True)
        deadline = started + args.timeout_min * 60
        budget = (up_at, args.minutes * 60) if args.minutes else None
        shown = 0
        metrics = MetricsTail(local.trainer_metrics)
        while True:
            rows = metrics.read()
            if len(rows) > shown:
                rejections = proxy_rejections(local.urls["proxy"])
                for row in rows[shown:]:
                    print(progress_line(row, config.steps, rejections, started, budget), flush=True)
                shown = len(rows)
                calls.sample(shown)
            steps = len(optimizer_steps(rows))
            if config.steps and steps >= config.steps:
                break
            if budget is not None and time.monotonic() - budget[0] >= budget[1]:
                stopped_by = "time"
                print(f"time budget of {args.minutes:g} minutes reached at step {steps}", flush=True)
                break
            dead = [s for s in local.stack.dead() if s.name != "trainer"]
            trainer_gone = any(s.name == "trainer" for s in local.stack.dead())
            if dead or (trainer_gone and steps < config.steps):
                who = dead[0] if dead else next(s for s in local.stack.services if s.name == "trainer")
                print(f"error: {who.name} exited early; see {who.log_path}", file=sys.stderr)
                code = 1
                break
            if time.monotonic() > deadline:
                print(f"error: timed out after {args.timeout_min} min at step {steps}", file=sys.stderr)
                code = 1
                break
            if usage is not None:
                usage.sample(local.urls["engine"])
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
            rejections = max(rejections, proxy_rejections(local.urls["proxy"]))
            tool_calls = proxy_tool_calls(local.urls["proxy"])
            if tool_calls is not None and tool_calls["well_formed_share"] is None and not offers_tools(config.task):
                tool_calls = None  # a task without tools whose replies never held call markup: nothing to say
            local.stop()
            print("stopped every process the demo started", flush=True)
    wall = time.monotonic() - started
    rows = rows_so_far(config.run_dir / "trainer" / "metrics.jsonl") or rows  # a stopping trainer adds its last step
    if rows:
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
