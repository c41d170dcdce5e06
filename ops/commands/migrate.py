"""``rein migrate``: move a run's Redis keys to today's layout (logic in :mod:`ops.migrate`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import redis

from ops.commands import add_command, add_redis, add_run_dir
from ops.migrate import MigrationRefused, migrate
from ops.status import RunDirError, read_run_dir, redis_target
from shared.names import RedisKeys
from shared.settings import ServiceSettings, SettingsError, load
from shared.state import StateUnavailable, connect

EPILOG = """\
A run started by a rein before the keys carried their prefix as a hash tag keeps its window under
`rein:window`, `rein:versions:...`; today's collector refuses to start on it. Stop every service of
the run, migrate, start them again: the window, its pending groups, the decisions, the version
registry, the outbox and the prompt cursors go on where they were. Safe to run again.

Redis: --redis, else RUN_DIR/stack.json of a `rein up` / `make demo` run (--run-dir), else
REIN_REDIS__URL (and REIN_REDIS__SENTINELS).

Examples:
  rein migrate --run-dir runs/demo --dry-run
  rein migrate --redis redis://127.0.0.1:6379/0 --key-prefix rein
"""


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "migrate",
        summary="move a run's Redis keys from the layout before the hash tag to today's",
        description="Move a run's Redis keys from the layout before the hash tag ({rein}:...) to today's.",
        epilog=EPILOG,
    )
    add_run_dir(parser)
    add_redis(parser)
    parser.add_argument("--dry-run", action="store_true", help="say what would move, change nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        run_dir = read_run_dir(args.run_dir) if args.run_dir is not None else None
        settings = redis_target(load(ServiceSettings).redis, run_dir, args.redis, args.key_prefix)
        keys = RedisKeys(settings.key_prefix)
        client = connect(settings)
    except (ValueError, SettingsError, RunDirError, StateUnavailable) as exc:
        print(f"rein migrate: error: {exc}", file=sys.stderr)
        return 2
    try:
        done = migrate(client, keys, dry_run=args.dry_run)
    except (MigrationRefused, ValueError, redis.RedisError) as exc:
        print(f"rein migrate: refused: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    verb = "would move" if args.dry_run else "moved"
    print(f"{verb} {len(done.moved)} keys to {keys.tag}:..., {'would delete' if args.dry_run else 'deleted'} "
          f"{len(done.duplicates)} old copies of keys already moved; {len(done.done)} were moved before")
    for key in done.moved:
        print(f"  {key}")
    return 0
