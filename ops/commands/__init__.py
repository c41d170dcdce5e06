"""Subcommands of the ``rein`` CLI: one module each, exposing ``register(subparsers)``.

``register`` adds the subcommand's parser and sets ``func`` (args -> exit code)
with ``parser.set_defaults(func=...)``. The helpers below hold what several subcommands
declare alike, so a shared flag is spelled and explained once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_command(subparsers: Any, name: str, *, summary: str, description: str | None, epilog: str | None = None
                ) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``; ``summary`` is its line in ``rein --help``. Its description and
    epilog keep their line breaks (the examples are laid out by hand)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=description, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def add_run_dir(parser: argparse.ArgumentParser) -> None:
    """``--run-dir``: where to find the services of a local run (its ``stack.json``)."""
    parser.add_argument("--run-dir", type=Path, metavar="DIR", help="a `rein up` / `make demo` run directory")


def add_redis(parser: argparse.ArgumentParser) -> None:
    """``--redis`` and ``--key-prefix``: which Redis, and which deployment's keys in it."""
    parser.add_argument("--redis", metavar="URL", help="Redis URL (redis://host:port/db)")
    parser.add_argument("--key-prefix", metavar="P", help="Redis key prefix of the deployment (default: rein)")
