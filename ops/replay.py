"""What-if replay of the batch window over a recorded run, pure.

``rein replay`` (``ops/commands/replay.py``) reads a run either from the
``rollout.groups`` + ``weights`` (+ ``staleness.decisions`` for order) topics or
from a JSONL file (format in ``docs/replay.md``), and folds it through the same
:func:`shared.window_rule.window_step` the collector runs against Redis, with an
in-memory :class:`shared.versions.VersionRegistry`. Nothing here touches live state.
A JSONL file is where its labels enter, so :func:`parse_event` normalises them; the
topics' records come normalised by their schema.

A recorded group is turned into what the window judges by :mod:`shared.window_view`,
the same code the live collector uses, so the live and the replayed rule cannot drift apart.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from shared.schemas import CompletedGroup
from shared.staleness import UNTRAINED_CAUSES, Decision, TokenTally, WindowGroup, WindowSettings
from shared.version_window import SegmentEnd
from shared.versions import VersionRegistry, real_version
from shared.window_rule import WindowReplay
from shared.window_view import group_rewards, segment_ends, window_group_from_samples

# --------------------------------------------------------------------------- recorded events


@dataclass(frozen=True)
class WeightEvent:
    """A published weight version: label and the trainer's sequence number."""

    version: str
    seq: int


@dataclass(frozen=True)
class GroupEvent:
    """A completed group as recorded: identity, failure, its samples' end versions and its rewards."""

    group_id: str
    prompt_id: str
    attempt: int
    failed: bool
    samples: tuple[SegmentEnd, ...]
    rewards: tuple[float, ...] | None = None
    """Each trajectory's reward; None when the recording has none (the group then counts as carrying signal)."""

    def window_group(self) -> WindowGroup:
        return window_group_from_samples(
            self.group_id, self.prompt_id, self.attempt, self.failed, self.samples, self.rewards
        )


ReplayEvent = WeightEvent | GroupEvent


class ReplayFormatError(ValueError):
    """A JSONL line is not a valid replay event; the message names the line."""


def _require(obj: dict[str, Any], key: str, kinds: type | tuple[type, ...], lineno: int) -> Any:
    if key not in obj:
        raise ReplayFormatError(f"line {lineno}: missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ReplayFormatError(f"line {lineno}: field {key!r} has the wrong type ({value!r})")
    return value


def parse_event(obj: object, lineno: int = 0) -> ReplayEvent:
    """One JSON object of the replay format -> event (see ``docs/replay.md``)."""
    if not isinstance(obj, dict):
        raise ReplayFormatError(f"line {lineno}: expected a JSON object")
    kind = obj.get("kind")
    if kind == "weight":
        label = real_version(_require(obj, "version", (str, int), lineno))
        seq = _require(obj, "seq", int, lineno)
        if label is None or seq < 0:
            raise ReplayFormatError(f"line {lineno}: weight needs a real version and seq >= 0")
        return WeightEvent(label, seq)
    if kind == "group":
        samples_raw = _require(obj, "samples", list, lineno)
        samples = []
        for i, sample in enumerate(samples_raw):
            if not isinstance(sample, dict):
                raise ReplayFormatError(f"line {lineno}: samples[{i}] is not an object")
            traj = sample.get("trajectory_id")
            seg = sample.get("segment_index", 0)
            if isinstance(seg, bool) or not isinstance(seg, int):
                raise ReplayFormatError(f"line {lineno}: samples[{i}].segment_index must be an integer")
            end = real_version(sample.get("end_version"))
            tokens = sample.get("tokens", 0)
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise ReplayFormatError(f"line {lineno}: samples[{i}].tokens must be an integer >= 0")
            samples.append(SegmentEnd(None if traj is None else str(traj), seg, end, tokens))
        attempt = obj.get("attempt", 0)
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ReplayFormatError(f"line {lineno}: attempt must be an integer >= 0")
        failed = obj.get("failed", False)
        if not isinstance(failed, bool):
            raise ReplayFormatError(f"line {lineno}: failed must be true or false")
        rewards = obj.get("rewards")
        if rewards is not None and (
            not isinstance(rewards, list)
            or not all(isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) for r in rewards)
        ):
            raise ReplayFormatError(f"line {lineno}: rewards must be a list of finite numbers")
        return GroupEvent(
            group_id=str(_require(obj, "group_id", str, lineno)),
            prompt_id=str(obj.get("prompt_id", "")),
            attempt=attempt,
            failed=failed,
            samples=tuple(samples),
            rewards=None if rewards is None else tuple(float(r) for r in rewards),
        )
    raise ReplayFormatError(f"line {lineno}: kind must be 'weight' or 'group', got {kind!r}")


def read_jsonl(lines: Iterable[str]) -> Iterator[ReplayEvent]:
    """Events of a JSONL file, in file order; blank lines and ``#`` comments are skipped."""
    for lineno, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ReplayFormatError(f"line {lineno}: not JSON ({exc.msg})") from None
        yield parse_event(obj, lineno)


def event_to_json(event: ReplayEvent) -> dict[str, Any]:
    """The JSONL object of one event (inverse of :func:`parse_event`)."""
    if isinstance(event, WeightEvent):
        return {"kind": "weight", "version": event.version, "seq": event.seq}
    rewards = {} if event.rewards is None else {"rewards": list(event.rewards)}
    return {
        "kind": "group",
        "group_id": event.group_id,
        "prompt_id": event.prompt_id,
        "attempt": event.attempt,
        "failed": event.failed,
        "samples": [
            {"trajectory_id": s.trajectory_id, "segment_index": s.segment_index, "end_version": s.end_version,
             **({"tokens": s.tokens} if s.tokens else {})}
            for s in event.samples
        ],
        **rewards,
    }


def group_event(group: CompletedGroup) -> GroupEvent:
    """A recorded group from its ``rollout.groups`` record."""
    return GroupEvent(
        group.group_id, group.prompt_id, group.attempt, group.failed, tuple(segment_ends(group)),
        tuple(group_rewards(group)),
    )


# --------------------------------------------------------------------------- the fold


@dataclass(frozen=True)
class GroupOutcome:
    """A group's final decision in the replay, and the batch it went into (None if none)."""

    group_id: str
    prompt_id: str
    attempt: int
    decision: Decision
    batch: int | None
    versions: tuple[str, ...]
    withheld: tuple[str, ...] = ()
    """Members withheld (``stale_groups`` ``withhold``), as of the batch that took the group (or the end)."""


@dataclass
class ReplayReport:
    """Every group's final decision (first-seen order) and the summary ``rein replay`` prints."""

    keep_versions: int
    batch_groups: int
    no_signal_groups: str = "drop"
    stale_groups: str = "drop"
    outcomes: dict[str, GroupOutcome] = field(default_factory=dict)
    batches: int = 0
    gap_min: int | None = None
    gap_max: int | None = None
    gap_sum: float = 0.0
    gap_count: int = 0
    duplicates: int = 0
    unregistered: list[str] = field(default_factory=list)
    tokens: TokenTally = field(default_factory=TokenTally)
    """The window's token tally at the end (tokens are 0 where the recording has no counts)."""

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(o.decision.value for o in self.outcomes.values())
        return {d.value: counted.get(d.value, 0) for d in Decision}

    @property
    def gap_mean(self) -> float | None:
        return self.gap_sum / self.gap_count if self.gap_count else None

    def decisions(self) -> dict[str, str]:
        """group id -> final decision name."""
        return {gid: o.decision.value for gid, o in self.outcomes.items()}

    def summary(self) -> dict[str, Any]:
        counts = self.counts
        return {
            "keep_versions": self.keep_versions,
            "batch_groups": self.batch_groups,
            "no_signal_groups": self.no_signal_groups,
            "stale_groups": self.stale_groups,
            "groups": len(self.outcomes),
            "kept": counts[Decision.KEPT.value],
            "kept_in_batches": sum(1 for o in self.outcomes.values() if o.batch is not None),
            "dropped": sum(n for name, n in counts.items() if name != Decision.KEPT.value and name != "failed_retry"),
            "decisions": counts,
            "batches": self.batches,
            "withheld_members": sum(len(o.withheld) for o in self.outcomes.values() if o.decision is Decision.KEPT),
            "tokens": {"generated": self.tokens.generated, "untrained": self.tokens.by_cause()},
            "version_gap": None
            if self.gap_count == 0
            else {"min": self.gap_min, "max": self.gap_max, "mean": self.gap_mean, "trajectories": self.gap_count},
            "duplicate_groups_skipped": self.duplicates,
            "unregistered_versions": list(self.unregistered),
        }


def replay(events: Iterable[ReplayEvent], config: WindowSettings) -> ReplayReport:
    """Fold recorded events through the window in order; a group id seen twice is skipped."""
    registry = VersionRegistry()
    fold = WindowReplay(config, registry.index)
    report = ReplayReport(
        config.keep_versions, config.batch_groups, config.no_signal_groups.value, config.stale_groups.value
    )
    for event in events:
        if isinstance(event, WeightEvent):
            registry.publish(event.version, event.seq)
            continue
        if event.group_id in report.outcomes:
            report.duplicates += 1
            continue
        group = event.window_group()
        for version in group.versions:
            registry.observe(version)
        result = fold.feed(group)
        for decision in result.decisions:
            report.outcomes[decision.group_id] = GroupOutcome(
                decision.group_id, decision.prompt_id, decision.attempt, decision.decision, None, decision.versions
            )
        if result.batch is not None:
            report.batches += 1
            for taken in result.batch.groups:
                held = report.outcomes[taken.group_id]
                report.outcomes[taken.group_id] = GroupOutcome(
                    held.group_id, held.prompt_id, held.attempt, held.decision, result.batch.index, held.versions,
                    taken.withheld,
                )
            gap = result.batch.gap
            if gap is not None:
                report.gap_min = gap.min if report.gap_min is None else min(report.gap_min, gap.min)
                report.gap_max = gap.max if report.gap_max is None else max(report.gap_max, gap.max)
                report.gap_sum += gap.mean * gap.count
                report.gap_count += gap.count
    for pending in fold.state.pending:
        report.outcomes[pending.group_id] = replace(report.outcomes[pending.group_id], withheld=pending.withheld)
    report.unregistered = registry.unregistered
    report.tokens = fold.state.tokens
    return report


WINDOW_DECISIONS = tuple(d.value for d, cause in UNTRAINED_CAUSES.items() if cause == "window")
"""``dropped_stale``, ``dropped_retroactive``: the decisions that drop a group for staleness."""


def withhold_vs_drop(withhold: ReplayReport, drop: ReplayReport) -> dict[str, Any]:
    """What withholding saved beside dropping whole groups, from two replays of the same events.

    ``groups_saved``: fewer groups dropped for staleness. ``tokens_saved``: fewer tokens left untrained
    by staleness (the window's drops, plus the members withheld under ``withhold``); 0 without token counts.
    """
    def window_drops(report: ReplayReport) -> int:
        return sum(report.counts[d] for d in WINDOW_DECISIONS)

    stale_tokens_drop = drop.tokens.window + drop.tokens.withheld
    stale_tokens_withhold = withhold.tokens.window + withhold.tokens.withheld
    return {
        "window_drops": {"drop": window_drops(drop), "withhold": window_drops(withhold)},
        "groups_saved": window_drops(drop) - window_drops(withhold),
        "withheld_members": withhold.summary()["withheld_members"],
        "stale_tokens_untrained": {"drop": stale_tokens_drop, "withhold": stale_tokens_withhold},
        "tokens_saved": stale_tokens_drop - stale_tokens_withhold,
    }

