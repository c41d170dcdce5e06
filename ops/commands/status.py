"""``rein status``: one look at a running system (logic in :mod:`ops.status`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ops.commands import add_command, add_redis, add_run_dir
from ops.status import (
    DEFAULT_GROUPS,
    RunDir,
    RunDirError,
    StatusSettings,
    Targets,
    collect,
    read_run_dir,
    redis_target,
)
from ops.status_render import render
from shared.names import namespaced
from shared.settings import SettingsError, load

EPILOG = """\
Reports the version registry and the window (current version and index, cutoff,
keep_versions, pending groups, batches, drops by reason, untrained tokens by cause
and their share of generated) from Redis; consumer lag
(end offset - committed offset) of each service's consumer group; each proxy's pause
state and rejection counts; each engine's loaded weight version. A part that cannot
be reached is shown as an error; every call is bounded by --timeout.

Where to look: --run-dir reads RUN_DIR/stack.json of a `rein up` / `make demo` run
(Kafka, Redis, service URLs, admin token). Otherwise REIN_KAFKA__BOOTSTRAP_SERVERS,
REIN_REDIS__URL, REIN_REDIS__KEY_PREFIX, REIN_PROXY_URLS, REIN_ENGINE_URLS and
REIN_ADMIN_TOKEN, overridden by the flags below.

Exit status: 0 when every part answered, 1 when some part is an error, 2 on bad arguments.

Examples:
  rein status --run-dir runs/demo
  rein status --kafka 127.0.0.1:9092 --redis redis://127.0.0.1:6379/0 --proxy http://127.0.0.1:8000
  rein status --run-dir runs/demo --json | jq .window
"""


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "status",
        summary="window, registry, consumer lag, proxy pause state and engine versions of a running system",
        description="Show the state of a running rein system: version window, consumer lag, proxies, engines.",
        epilog=EPILOG,
    )
    add_run_dir(parser)
    parser.add_argument("--kafka", metavar="HOST:PORT", help="Kafka bootstrap servers")
    add_redis(parser)
    parser.add_argument("--proxy", action="append", metavar="URL", help="a proxy base URL (repeatable)")
    parser.add_argument("--engine", action="append", metavar="URL", help="an engine base URL (repeatable)")
    parser.add_argument("--admin-token", metavar="T", help="bearer token of the proxies' admin endpoints")
    parser.add_argument(
        "--group",
        action="append",
        metavar="G",
        default=None,
        help=f"consumer group to report (repeatable; default: {', '.join(DEFAULT_GROUPS)})",
    )
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S", help="bound on each call (default 5 s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def targets_from_args(args: argparse.Namespace, settings: StatusSettings) -> Targets:
    """Flags over the run directory over the environment."""
    run_dir: RunDir | None = read_run_dir(args.run_dir) if args.run_dir is not None else None
    kafka = settings.kafka
    bootstrap = args.kafka or (run_dir.kafka_bootstrap if run_dir else None)
    if bootstrap:
        kafka = kafka.model_copy(update={"bootstrap_servers": bootstrap})
    namespace = run_dir.namespace if run_dir else ""
    redis = redis_target(settings.redis, run_dir, args.redis, args.key_prefix or namespace or None)
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    kafka = kafka.model_copy(update={"request_timeout_ms": int(args.timeout * 1000)})
    redis = redis.model_copy(update={"socket_timeout_s": args.timeout})
    proxies = args.proxy or (run_dir.proxies if run_dir else None) or list(settings.proxy_urls)
    engines = args.engine or (run_dir.engines if run_dir else None) or list(settings.engine_urls)
    token = args.admin_token or (run_dir.admin_token if run_dir else "") or settings.admin_token
    groups = {namespaced(g, namespace): topics for g, topics in DEFAULT_GROUPS.items()}
    if args.group:
        groups = {g: groups.get(g, ()) for g in args.group}
    services = {}
    if run_dir is not None:
        services = {name: url for name, url in run_dir.urls.items() if name not in ("proxy", "engine")}
    return Targets(
        kafka=kafka,
        redis=redis,
        topics=settings.topics.under(namespace),
        groups=groups,
        proxies=proxies,
        engines=engines,
        services=services,
        admin_token=token,
        timeout_s=args.timeout,
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = load(StatusSettings)
        targets = targets_from_args(args, settings)
    except (ValueError, SettingsError, RunDirError) as exc:
        print(f"rein status: error: {exc}", file=sys.stderr)
        return 2
    report = collect(targets)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(render(report) + "\n")
    sys.stdout.flush()
    return 0 if report["ok"] else 1
