"""``rein replay`` answers with the live run's decisions when given the live run's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from ops.cli import main as rein
from shared.names import RedisKeys
from shared.window_layout import WindowReader
from tests.support.collector import Running, Source, Tail, final_decisions, make_settings

pytestmark = [pytest.mark.integration]

DIFFER = {"rewards": [0.0, 1.0]}
STREAM: list[tuple[str, list[list[str | None]], dict[str, object]]] = [
    ("a", [["v1"], ["v1"]], DIFFER),
    ("b", [["v1"], [None]], DIFFER),
    ("c", [["v2"], ["v2"]], DIFFER),  # advance: a and b leave (keep 1)
    ("d", [["v0"]], {}),  # stale straggler
    ("e", [["v2"]], {"attempt": 0, "rejected": [0]}),  # failed: retry
    ("f", [["v2"], ["v2"]], DIFFER),
    ("n", [["v2"], ["v2"]], {}),  # every reward 1.0: no signal
    ("g", [[(0, "v3"), (1, "v2")], ["v2"]], DIFFER),  # the highest segment (v2) decides
    ("h", [["v3"]], {}),  # advance: c, f, g leave unless batched; alone, it has no signal
]


def _replay(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    capsys.readouterr()  # drop the collector's log lines
    assert rein(["replay", *args, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_replay_of_a_recorded_run_gives_the_live_decisions(
    kafka_bootstrap: str,
    redis_db_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=1, batch_groups=2, no_signal_groups="drop")
    source = Source(settings, ["v0", "v1", "v2", "v3"])
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        for gid, trajs, kw in STREAM:
            source.group(gid, trajs, **kw)  # type: ignore[arg-type]
        live = final_decisions(tail.wait(lambda rs: len(final_decisions(rs)) == len(STREAM), "all decisions"))
        client = redis.Redis.from_url(settings.redis.url, decode_responses=True)
        live_tally = WindowReader(client, RedisKeys(settings.redis.key_prefix)).window().tokens
    assert set(live.values()) >= {"kept", "dropped_retroactive", "dropped_stale", "failed_retry", "dropped_no_signal"}

    monkeypatch.setenv("REIN_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("REIN_TOPICS__WEIGHTS", settings.topics.weights)
    monkeypatch.setenv("REIN_TOPICS__DECISIONS", settings.topics.decisions)
    export = tmp_path / "run.jsonl"
    common = ["--keep-versions", "1", "--batch-groups", "2"]
    from_topic = _replay(capsys, "--from-topic", settings.topics.groups, *common, "--export", str(export))
    decisions = {g["group_id"]: g["decision"] for g in from_topic["groups"]}  # type: ignore[attr-defined]
    assert decisions == live
    assert from_topic["summary"]["tokens"] == {  # type: ignore[index]
        "generated": live_tally.generated, "untrained": live_tally.by_cause(),
    }, "the replay counts the tokens the live window counted"
    assert live_tally.generated > 0

    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert [line["kind"] for line in lines[:4]] == ["weight"] * 4
    assert [line["group_id"] for line in lines[4:]] == [gid for gid, _, _ in STREAM]
    from_file = _replay(capsys, "--from-file", str(export), *common)
    assert {g["group_id"]: g["decision"] for g in from_file["groups"]} == live  # type: ignore[attr-defined]

    # what-if: with the window off nothing is dropped for staleness
    off = _replay(capsys, "--from-file", str(export), "--keep-versions", "0", "--batch-groups", "2")
    summary = off["summary"]
    assert summary["decisions"]["dropped_stale"] == 0  # type: ignore[index]
    assert summary["decisions"]["dropped_retroactive"] == 0  # type: ignore[index]
    # what-if: groups without signal kept, as before the rule
    kept = _replay(capsys, "--from-file", str(export), *common, "--no-signal-groups", "keep")
    assert kept["summary"]["decisions"]["dropped_no_signal"] == 0  # type: ignore[index]
    assert {g["group_id"]: g["decision"] for g in kept["groups"]}["n"] == "kept"  # type: ignore[attr-defined]
    # what-if: stale members withheld instead of whole groups dropped, reported beside the drop
    withhold = _replay(capsys, "--from-file", str(export), *common, "--stale-groups", "withhold")
    beside = withhold["withhold_vs_drop"]
    assert beside["window_drops"]["drop"] == sum(  # type: ignore[index]
        1 for d in live.values() if d in ("dropped_stale", "dropped_retroactive")
    )
    assert beside["groups_saved"] >= 0 and beside["tokens_saved"] >= 0  # type: ignore[index,operator]
    source.close()
    tail.close()
