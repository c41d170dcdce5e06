"""``rein report RUN_DIR``: render a run's ``metrics.jsonl`` to a PNG (logic in :mod:`ops.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ops.report import plot_run, read_metrics

METRICS_FILE = "metrics.jsonl"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="plot a run's metrics to PNG",
        description=(
            "Render RUN_DIR/metrics.jsonl (one JSON object per manifest the trainer consumed) to a PNG: "
            "reward, version gap min/max/mean, drops, cumulative untrained tokens by cause, train/rollout "
            "logprob difference and masked-token fraction, each only if present. Prints the PNG's path."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where to write report.png (default: RUN_DIR)")
    parser.add_argument("--title", help="figure title (default: the run directory's name)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    path = run_dir / METRICS_FILE if run_dir.is_dir() else run_dir
    if not path.is_file():
        print(f"rein report: error: no {METRICS_FILE} at {path}", file=sys.stderr)
        return 1
    loaded = read_metrics(path)
    if loaded.malformed:
        print(f"rein report: skipped {loaded.malformed} malformed lines of {path}", file=sys.stderr)
    if not loaded.rows:
        print(f"rein report: error: {path} has no metrics rows", file=sys.stderr)
        return 1
    out_dir: Path = args.out if args.out is not None else path.parent
    title = args.title or path.parent.resolve().name
    png = plot_run(loaded.rows, out_dir / "report.png", f"rein run {title} ({len(loaded.rows)} steps)")
    print(png)
    return 0
