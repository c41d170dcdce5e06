"""``rein replay``: what would the batch window have done to a recorded run?

Reads a run from Kafka (``--from-topic rollout.groups``, plus the ``weights``
topic for version order and ``staleness.decisions`` for the order the live
window took the groups in) or from a JSONL file (``--from-file``, format in
``docs/replay.md``), folds it through the same window as the collector, in memory,
and prints each group's final decision and a summary. ``--export F.jsonl`` writes
what it read in the file format, so a past run can be replayed again offline.
Live state (Redis, consumer groups) is never touched: topics are read without a
consumer group.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ops.commands import add_command
from ops.replay import (
    ReplayEvent,
    ReplayFormatError,
    ReplayReport,
    WeightEvent,
    event_to_json,
    group_event,
    read_jsonl,
    replay,
    withhold_vs_drop,
)
from shared.bus import read_topic
from shared.schemas import CompletedGroup, DecisionRecord, WeightPublished
from shared.settings import ServiceSettings, SettingsError, load
from shared.staleness import NoSignalGroups, StaleGroups, WindowSettings

WINDOW = WindowSettings()
"""The collector's window defaults (``REIN_BATCH_GROUPS``, ``REIN_MAX_RETRIES``, ...), the flags' defaults here."""


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "replay",
        summary="re-run the staleness window over a recorded run (what-if), without touching live state",
        description=__doc__,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-topic", metavar="TOPIC", help="read completed groups from this topic (rollout.groups)")
    source.add_argument("--from-file", metavar="FILE", type=Path, help="read events from a JSONL file")
    parser.add_argument("--keep-versions", type=int, required=True, help="window size N (0 = off)")
    parser.add_argument(
        "--batch-groups", type=int, default=WINDOW.batch_groups, help="groups per batch (default %(default)s)"
    )
    parser.add_argument(
        "--max-retries", type=int, default=WINDOW.max_retries, help="retries of a failed group (default %(default)s)"
    )
    parser.add_argument(
        "--no-signal-groups", choices=[p.value for p in NoSignalGroups], default=WINDOW.no_signal_groups.value,
        help="groups whose rewards are all equal: drop or keep them (default %(default)s, as REIN_NO_SIGNAL_GROUPS)",
    )
    parser.add_argument(
        "--stale-groups", choices=[p.value for p in StaleGroups], default=WINDOW.stale_groups.value,
        help="groups with members outside the window: drop them whole or withhold those members (default "
             "%(default)s, as REIN_STALE_GROUPS); withhold also replays drop and reports what it saved",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--export", metavar="FILE", type=Path, help="also write the events read as JSONL to FILE")
    parser.add_argument(
        "--bootstrap", metavar="HOST:PORT", help="Kafka brokers (default: REIN_KAFKA__BOOTSTRAP_SERVERS)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to read the topics (default %(default)s)")
    parser.set_defaults(func=run)


# --------------------------------------------------------------------------- reading Kafka


def events_from_topics(settings: ServiceSettings, groups_topic: str, timeout_s: float) -> list[ReplayEvent]:
    """Weights (by sequence), then groups in the order the live window stepped them.

    The order comes from the ``step`` of each group's first decision on
    ``staleness.decisions``; groups without a decision follow, by record time. A
    group id written twice (a collector crashed between writing it and deciding it)
    counts once.
    """
    weights = {
        r.version: r.seq
        for r in read_topic(settings.kafka, settings.topics.weights, timeout_s)
        if isinstance(r, WeightPublished)
    }
    first_step: dict[str, int] = {}
    for r in read_topic(settings.kafka, settings.topics.decisions, timeout_s):
        if isinstance(r, DecisionRecord) and r.step is not None:
            first_step[r.group_id] = min(r.step, first_step.get(r.group_id, r.step))
    groups: dict[str, CompletedGroup] = {}
    for r in read_topic(settings.kafka, groups_topic, timeout_s):
        if isinstance(r, CompletedGroup) and r.group_id not in groups:
            groups[r.group_id] = r
    inf = float("inf")
    ordered = sorted(groups.values(), key=lambda g: (first_step.get(g.group_id, inf), g.ts))
    events: list[ReplayEvent] = [WeightEvent(v, s) for v, s in sorted(weights.items(), key=lambda kv: kv[1])]
    events.extend(group_event(g) for g in ordered)
    return events


# --------------------------------------------------------------------------- output


def render_table(report: ReplayReport, beside: dict[str, Any] | None = None) -> str:
    lines = [f"{'group_id':<40} {'prompt_id':<20} {'att':>3} {'decision':<20} {'batch':>5}  versions"]
    for o in report.outcomes.values():
        batch = "" if o.batch is None else str(o.batch)
        lines.append(
            f"{o.group_id:<40} {o.prompt_id:<20} {o.attempt:>3} {o.decision.value:<20} {batch:>5}  "
            f"{','.join(o.versions) or '-'}"
        )
    s = report.summary()
    lines.append("")
    lines.append(
        f"keep_versions={s['keep_versions']} batch_groups={s['batch_groups']} "
        f"no_signal_groups={s['no_signal_groups']}: {s['groups']} groups, "
        f"kept {s['kept']} ({s['kept_in_batches']} in {s['batches']} batches), dropped {s['dropped']}"
    )
    lines.append("decisions: " + ", ".join(f"{k}={v}" for k, v in s["decisions"].items()))
    tokens = s["tokens"]
    if tokens["generated"]:
        lines.append(f"tokens: {tokens['generated']} generated, untrained "
                     + ", ".join(f"{k}={v}" for k, v in tokens["untrained"].items()))
    if beside is not None:
        drops = beside["window_drops"]
        stale = beside["stale_tokens_untrained"]
        lines.append(
            f"withhold beside drop: {beside['groups_saved']} groups saved ({drops['withhold']} dropped for staleness, "
            f"{drops['drop']} when dropped whole), {beside['withheld_members']} members withheld in kept groups, "
            f"{beside['tokens_saved']} tokens saved ({stale['withhold']} left untrained by staleness, "
            f"{stale['drop']} when dropped whole)"
        )
    gap = s["version_gap"]
    if gap is not None:
        lines.append(f"version gap over batched trajectories: min {gap['min']} max {gap['max']} mean {gap['mean']:.3f}")
    if s["unregistered_versions"]:
        lines.append("unregistered versions (placed after published ones): " + ", ".join(s["unregistered_versions"]))
    return "\n".join(lines)


def report_json(report: ReplayReport, beside: dict[str, Any] | None = None) -> dict[str, Any]:
    extra = {} if beside is None else {"withhold_vs_drop": beside}
    return {
        "groups": [
            {
                "group_id": o.group_id,
                "prompt_id": o.prompt_id,
                "attempt": o.attempt,
                "decision": o.decision.value,
                "batch": o.batch,
                "versions": list(o.versions),
                "withheld": list(o.withheld),
            }
            for o in report.outcomes.values()
        ],
        "summary": report.summary(),
        **extra,
    }


def run(args: argparse.Namespace) -> int:
    try:
        config = WindowSettings(
            keep_versions=args.keep_versions,
            batch_groups=args.batch_groups,
            max_retries=args.max_retries,
            no_signal_groups=NoSignalGroups(args.no_signal_groups),
            stale_groups=StaleGroups(args.stale_groups),
        )
    except ValueError as exc:
        print(f"rein replay: {exc}", file=sys.stderr)
        return 2
    try:
        if args.from_file is not None:
            with args.from_file.open() as f:
                events = list(read_jsonl(f))
        else:
            overrides: dict[str, Any] = {}
            settings = load(ServiceSettings)
            if args.bootstrap:
                overrides = {"kafka": settings.kafka.model_copy(update={"bootstrap_servers": args.bootstrap})}
                settings = settings.model_copy(update=overrides)
            events = events_from_topics(settings, args.from_topic, args.timeout)
    except (OSError, ReplayFormatError, SettingsError, LookupError, TimeoutError) as exc:
        print(f"rein replay: {exc}", file=sys.stderr)
        return 1
    if args.export is not None:
        with args.export.open("w") as f:
            for event in events:
                f.write(json.dumps(event_to_json(event)) + "\n")
    try:
        report = replay(events, config)
        beside = None
        if config.stale_groups is StaleGroups.WITHHOLD:
            dropping = config.model_copy(update={"stale_groups": StaleGroups.DROP})
            beside = withhold_vs_drop(report, replay(events, dropping))
    except ValueError as exc:  # e.g. two labels with one sequence number in the recording
        print(f"rein replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report_json(report, beside), indent=None))
    else:
        print(render_table(report, beside))
    return 0
