"""``rein tail TOPIC``: print a topic's records as JSON lines (logic in :mod:`ops.tail`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ops.commands import add_command, add_run_dir
from ops.status import read_run_dir
from ops.tail import Start, Tailer, TailError, TailOptions, parse_duration, parse_offset
from shared.settings import ServiceSettings, SettingsError, load

EPILOG = """\
Output: one JSON object per line on stdout,
  {"topic", "partition", "offset", "timestamp_ms", "key", "record": {...}}
or, for a record that does not decode, the same with "error": "<reason>: <message>" in
place of "record". A summary (lines printed, malformed records) goes to stderr.

Start: --from-beginning, --since DURATION (10m, 2h, 1d: records written since then),
or --offset P:O (partition P from offset O, that partition only). With none of them:
from the beginning, or at the end with --follow; with --group-id, the group's
committed offsets.

Without --follow, stops at the end offsets seen at start. The broker: --bootstrap, else
RUN_DIR/stack.json of a `rein up` / `make demo` run (--run-dir), else
REIN_KAFKA__BOOTSTRAP_SERVERS.

Examples:
  rein tail rollout.events --since 10m
  rein tail rollout.chunks --session sess-3f2a... --from-beginning
  rein tail train.batches --follow | jq .record.index
  rein tail staleness.decisions --run-dir runs/demo --from-beginning
"""


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "tail",
        summary="print a topic's records as JSON lines",
        description="Decode a topic's msgpack records to JSON lines, for replaying a topic while debugging.",
        epilog=EPILOG,
    )
    parser.add_argument("topic", metavar="TOPIC", help="topic name, e.g. rollout.chunks")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the first retained offset")
    start.add_argument("--since", metavar="DURATION", help="start at records written this long ago (10m, 2h, 1d)")
    start.add_argument("--offset", metavar="P:O", help="read partition P only, starting at offset O")
    parser.add_argument("--group-id", metavar="G", help="join consumer group G and commit as records are printed")
    parser.add_argument("--session", metavar="S", help="only records of session S (session_id / session_ids)")
    parser.add_argument("--follow", "-f", action="store_true", help="keep reading new records until Ctrl-C")
    parser.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap servers (default: settings)")
    add_run_dir(parser)
    parser.add_argument("--max", type=int, metavar="N", dest="max_records", help="stop after printing N lines")
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="stop after S seconds (default: none with --follow, 120 without, where not reaching the end is exit 1)",
    )
    parser.set_defaults(func=run)


def _start(args: argparse.Namespace) -> Start:
    if args.from_beginning:
        return Start.beginning()
    if args.since is not None:
        return Start.since(parse_duration(args.since))
    if args.offset is not None:
        partition, offset = parse_offset(args.offset)
        return Start.at(partition, offset)
    return Start()


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    try:
        settings = load(ServiceSettings)
        if args.max_records is not None and args.max_records < 1:
            raise ValueError(f"--max must be at least 1, got {args.max_records}")
        if args.timeout is not None and args.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {args.timeout}")
        options = TailOptions(topic=args.topic, start=_start(args), group_id=args.group_id, session=args.session,
                              follow=args.follow, max_records=args.max_records, timeout_s=args.timeout)
        bootstrap = args.bootstrap or (read_run_dir(args.run_dir).kafka_bootstrap if args.run_dir else None)
        kafka = settings.kafka
        if bootstrap:
            kafka = kafka.model_copy(update={"bootstrap_servers": bootstrap})
        tailer = Tailer(kafka, options, _write)
    except (ValueError, SettingsError, TailError) as exc:  # RunDirError is a ValueError
        print(f"rein tail: error: {exc}", file=sys.stderr)
        return 2
    code = 0
    try:
        tailer.run()
    except TailError as exc:
        print(f"rein tail: error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # The reader went away (| head): stop quietly, as Unix tools do.
        sys.stderr.write(tailer.stats.summary() + "\n")
        return 0
    stats = tailer.stats
    print(stats.summary(), file=sys.stderr)
    if not options.follow and stats.timed_out and not stats.reached_end and code == 0:
        print("rein tail: error: --timeout passed before the end offsets seen at start were reached", file=sys.stderr)
        code = 1
    return code
