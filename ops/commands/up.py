"""``rein up`` / ``rein down``: the local processes of ``make demo``, for people without Docker."""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ops.stack_flags import add_stack_flags, apply_preset, resolve_model, stack_config

DEFAULT_RUN_DIR = Path("runs/local")


def register(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="start Kafka, Redis and every rein service as local processes",
        description="Start Kafka, Redis and every rein service as local background processes "
        "(the same system `make demo` runs). Stop them with `rein down`.",
    )
    up.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="logs, weights, pids (default runs/local)")
    up.add_argument("--steps", type=int, default=0, help="trainer steps before it stops (0 = run until down)")
    add_stack_flags(up)  # the demo's, with its defaults per model
    up.set_defaults(func=run_up)

    down = sub.add_parser(
        "down",
        help="stop what `rein up` started",
        description="Stop every process `rein up` recorded in RUN_DIR/pids.json, then its Kafka and Redis.",
    )
    down.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    down.set_defaults(func=run_down)


def run_up(args: argparse.Namespace) -> int:
    from ops.local.launcher import LaunchError
    from ops.local.stack import start

    pid_file = args.run_dir / "pids.json"
    if pid_file.exists() and json.loads(pid_file.read_text() or "{}"):
        print(f"error: {args.run_dir} already has running processes; `rein down --run-dir {args.run_dir}` first")
        return 1
    apply_preset(args)
    try:
        config = stack_config(args, resolve_model(args.model), args.run_dir)
    except (ValueError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}")
        return 1
    try:
        local = start(config)
    except LaunchError as exc:
        print(f"error: {exc}")
        return 1
    print(
        json.dumps(
            {
                "run_dir": str(args.run_dir),
                "kafka": local.infra.kafka_bootstrap,
                "redis": local.infra.redis_url,
                "urls": local.urls,
                "credentials": asdict(local.credentials),
                "logs": str(args.run_dir / "logs"),
            },
            indent=2,
        )
    )
    return 0


def run_down(args: argparse.Namespace) -> int:
    from ops.local.launcher import stop_recorded

    stopped = stop_recorded(args.run_dir)
    print(json.dumps({"stopped": stopped, "run_dir": str(args.run_dir)}))
    return 0
