"""``rein``: the one command-line entry point (``rein --help``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module in ops/commands registers one subcommand; listed here in help order.
COMMANDS = ("up", "status", "replay", "tail", "report", "migrate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rein", description="rein: asynchronous agentic RL with bounded staleness (Kafka + Redis)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"ops.commands.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
