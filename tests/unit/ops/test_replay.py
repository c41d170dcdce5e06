"""The replay JSONL format and the pure replay fold."""

from __future__ import annotations

import json

import pytest

from ops.replay import ReplayFormatError, event_to_json, read_jsonl, replay, withhold_vs_drop
from shared.staleness import NoSignalGroups, StaleGroups, WindowSettings

RUN = [
    {"kind": "weight", "version": "v0", "seq": 0},
    {"kind": "weight", "version": "v1", "seq": 1},
    {
        "kind": "group",
        "group_id": "a",
        "prompt_id": "p",
        "attempt": 0,
        "failed": False,
        "samples": [{"trajectory_id": "t1", "segment_index": 0, "end_version": "v0"}],
    },
    {
        "kind": "group",
        "group_id": "b",
        "prompt_id": "p",
        "attempt": 0,
        "failed": False,
        "samples": [
            {"trajectory_id": "t2", "segment_index": 0, "end_version": "v1"},
            {"trajectory_id": "t2", "segment_index": 1, "end_version": None},
        ],
    },
    {"kind": "group", "group_id": "c", "prompt_id": "q", "attempt": 2, "failed": True, "samples": []},
    {"kind": "group", "group_id": "a", "prompt_id": "p", "attempt": 0, "failed": False, "samples": []},
]


def test_round_trip_and_fold() -> None:
    events = list(read_jsonl(json.dumps(obj) for obj in RUN))
    assert [event_to_json(e) for e in events][:2] == RUN[:2]
    report = replay(events, WindowSettings(keep_versions=1, batch_groups=8))
    assert report.decisions() == {"a": "dropped_retroactive", "b": "kept", "c": "failed_dropped"}
    assert report.duplicates == 1
    summary = report.summary()
    assert summary["kept"] == 1 and summary["dropped"] == 2 and summary["batches"] == 0
    off = replay(events, WindowSettings(keep_versions=0, batch_groups=2))
    assert off.decisions() == {"a": "kept", "b": "kept", "c": "failed_dropped"}
    assert off.batches == 1 and off.summary()["version_gap"] == {"min": 0, "max": 1, "mean": 0.5, "trajectories": 2}


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"kind": "nope"}',
        '{"kind": "weight", "version": "v0"}',
        '{"kind": "weight", "version": "unknown", "seq": 1}',
        '{"kind": "group", "samples": []}',
        '{"kind": "group", "group_id": "g", "samples": [{"segment_index": "x"}]}',
        '{"kind": "group", "group_id": "g", "failed": "yes", "samples": []}',
        '{"kind": "group", "group_id": "g", "samples": [], "rewards": 1.0}',
        '{"kind": "group", "group_id": "g", "samples": [], "rewards": [1.0, "x"]}',
        '{"kind": "group", "group_id": "g", "samples": [], "rewards": [true, false]}',
        '{"kind": "group", "group_id": "g", "samples": [{"trajectory_id": "t", "tokens": -1}]}',
        '{"kind": "group", "group_id": "g", "samples": [{"trajectory_id": "t", "tokens": 1.5}]}',
    ],
)
def test_bad_lines_name_the_line(line: str) -> None:
    with pytest.raises(ReplayFormatError, match="line 2"):
        list(read_jsonl(["# comment", line]))


def _flat(group_id: str, rewards: list[float] | None) -> dict[str, object]:
    line: dict[str, object] = {
        "kind": "group",
        "group_id": group_id,
        "prompt_id": f"p-{group_id}",
        "attempt": 0,
        "failed": False,
        "samples": [{"trajectory_id": f"{group_id}-{i}", "segment_index": 0, "end_version": "v0"} for i in range(2)],
    }
    if rewards is not None:
        line["rewards"] = rewards
    return line


def test_rewards_decide_signal_and_survive_export() -> None:
    run = [RUN[0], _flat("flat", [1.0, 1.0]), _flat("mixed", [0.0, 1.0]), _flat("unknown", None)]
    events = list(read_jsonl(json.dumps(obj) for obj in run))
    assert [event_to_json(e) for e in events] == run
    dropped = replay(events, WindowSettings(keep_versions=1, batch_groups=8))
    assert dropped.decisions() == {"flat": "dropped_no_signal", "mixed": "kept", "unknown": "kept"}
    assert dropped.summary()["dropped"] == 1 and dropped.summary()["no_signal_groups"] == "drop"
    kept = replay(events, WindowSettings(keep_versions=1, batch_groups=8, no_signal_groups=NoSignalGroups.KEEP))
    assert set(kept.decisions().values()) == {"kept"}


def _members(group_id: str, *members: tuple[str, int]) -> dict[str, object]:
    """A group line whose members (``(end version, tokens)``) differ in version; rewards differ (signal)."""
    return {
        "kind": "group", "group_id": group_id, "prompt_id": f"p-{group_id}", "attempt": 0, "failed": False,
        "samples": [{"trajectory_id": f"{group_id}-{i}", "segment_index": 0, "end_version": v, "tokens": n}
                    for i, (v, n) in enumerate(members)],
        "rewards": [float(i) for i in range(len(members))],
    }


def test_withhold_beside_drop_reports_the_groups_and_tokens_it_saved() -> None:
    run = [
        *({"kind": "weight", "version": f"v{i}", "seq": i} for i in range(4)),
        _members("a", ("v1", 5), ("v1", 5)),
        _members("b", ("v0", 3), ("v2", 4)),  # current v2, keep 2: b-0 outside
        _members("c", ("v3", 2), ("v1", 6), ("v2", 1)),  # current v3: a leaves; b-1 inside; c-1 outside
        _members("d", ("v0", 1), ("v1", 1)),  # nothing inside: dropped under both
    ]
    events = list(read_jsonl(json.dumps(obj) for obj in run))
    assert [event_to_json(e) for e in events] == run, "token counts survive export"
    config = WindowSettings(keep_versions=2, batch_groups=8)
    drop = replay(events, config)
    assert drop.decisions() == {"a": "dropped_retroactive", "b": "dropped_stale", "c": "dropped_stale",
                                "d": "dropped_stale"}
    assert drop.summary()["tokens"] == {"generated": 28, "untrained": {"window": 28, "no_signal": 0, "failed": 0,
                                                                         "withheld": 0}}
    withhold = replay(events, WindowSettings(keep_versions=2, batch_groups=8, stale_groups=StaleGroups.WITHHOLD))
    assert withhold.decisions() == {"a": "dropped_retroactive", "b": "kept", "c": "kept", "d": "dropped_stale"}
    assert withhold.outcomes["c"].withheld == ("c-1",) and withhold.outcomes["b"].withheld == ("b-0",)
    assert withhold.summary()["stale_groups"] == "withhold" and withhold.summary()["withheld_members"] == 2
    assert withhold_vs_drop(withhold, drop) == {
        "window_drops": {"drop": 4, "withhold": 2},
        "groups_saved": 2,
        "withheld_members": 2,
        "stale_tokens_untrained": {"drop": 28, "withhold": 10 + 2 + 3 + 6},
        "tokens_saved": 28 - 21,
    }
