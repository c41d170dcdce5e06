"""The staleness window end to end through one collector, plus retries, manifests, poison records.

The window keeps the newest ``keep_versions`` versions, ranked in the order they were published. Topics have one
partition here, so the collector takes groups in the order they were written and every decision is deterministic.
"""

from __future__ import annotations

import msgpack
import pytest
import redis
from kafka import KafkaProducer

from services.collector.synthetic import group_records
from shared.bus import read_at
from shared.codec import encode
from shared.names import RedisKeys
from shared.schemas import CompletedGroup, DecisionRecord, RetryRequest, SessionFinished
from shared.staleness import TokenTally
from shared.window_layout import WindowReader, decode_window
from tests.support.collector import (
    Running,
    Source,
    Tail,
    decided,
    distinct_retries,
    final_decisions,
    make_settings,
    manifests_by_index,
    steps_of,
    wait_settled,
)

pytestmark = [pytest.mark.integration]


def test_sliding_window_whole_group_drops_and_retroactive_removal_only_on_advance(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2)
    source = Source(settings, ["v0", "v1", "v2", "v3"])
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        source.group("A", [["v0"], ["v0"]])  # current v0: kept
        source.group("B", [["v1"], ["v1"]])  # current v1, cutoff 0: A stays
        source.group("C", [["v2"], ["v0"]])  # current v2, cutoff 1: A leaves; C has a v0 member: whole group out
        source.group("D", [["v1"], ["v2"]])  # inside [v1, v2]: kept
        source.group("E", [["v0"]])  # below the cutoff: stale
        first = decided(tail, ["A", "B", "C", "D", "E"])
        assert first == {
            "A": "dropped_retroactive",
            "B": "kept",
            "C": "dropped_stale",
            "D": "kept",
            "E": "dropped_stale",
        }
        source.group("F", [["v2"]])  # no advance: nothing pending is re-checked
        decided(tail, ["F"])
        assert final_decisions(tail.records)["B"] == "kept"
        source.group("G", [["v3"]])  # advance to v3, cutoff 2: B and D leave
        final = decided(tail, ["G"])
        records = tail.wait(lambda rs: final_decisions(rs).get("D") == "dropped_retroactive", "D retro-dropped")
        final = final_decisions(records)
    assert {k: final[k] for k in "BDFG"} == {
        "B": "dropped_retroactive",
        "D": "dropped_retroactive",
        "F": "kept",
        "G": "kept",
    }
    g_step = steps_of(records, "G")[0][0]
    assert steps_of(records, "B") == [(1, "kept"), (g_step, "dropped_retroactive")]
    retro = [r for r in records if isinstance(r, DecisionRecord) and r.decision == "dropped_retroactive"]
    assert all(r.window.current_version in ("v2", "v3") for r in retro)
    g = next(r for r in records if isinstance(r, DecisionRecord) and r.group_id == "G")
    assert (g.window.current_version, g.window.current_index, g.window.cutoff_index) == ("v3", 3, 2)
    # 4 trainable tokens per trajectory; A, B and D were pending when they left: their tokens count then
    client = redis.Redis.from_url(settings.redis.url, decode_responses=True)
    tally = WindowReader(client, RedisKeys(settings.redis.key_prefix)).window().tokens
    assert tally == TokenTally(generated=8 * 4 + 4 * 3, window=8 + 8 + 4 + 8 + 8, no_signal=0, failed=0)
    source.close()
    tail.close()


def test_highest_segment_decides_and_unversioned_samples_are_ignored(kafka_bootstrap: str, redis_db_url: str) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=1)
    source = Source(settings, ["v0", "v1", "v2"])
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        # segment 0 ends on v2, segment 1 (the highest) on v1: the trajectory counts as v1
        source.group("H", [[(0, "v2"), (1, "v1")], [(0, "v1")]])
        source.group("I", [[(0, "v1"), (1, "v2")]])  # highest segment v2: advance, H (v1) leaves
        source.group("J", [[None], [None]])  # no versioned trajectory: never stale, never moves the window
        source.group("K", [[None], ["v2"]])  # the unversioned member is ignored
        source.group("L", [["v0"]])
        final = decided(tail, ["H", "I", "J", "K", "L"])
    assert final == {"H": "dropped_retroactive", "I": "kept", "J": "kept", "K": "kept", "L": "dropped_stale"}
    h = next(r for r in tail.records if isinstance(r, DecisionRecord) and r.group_id == "H")
    assert h.versions == ["v1", "v1"] and h.window.current_version == "v1"
    j = next(r for r in tail.records if isinstance(r, DecisionRecord) and r.group_id == "J")
    assert j.versions == [] and j.window.current_version == "v2"
    source.close()
    tail.close()


def test_late_straggler_on_an_older_published_label_is_stale_and_does_not_move_the_window(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    """A label first seen late is not ranked newest: versions rank in the order they were published, not seen."""
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=1)
    source = Source(settings, ["v0", "v1", "v2"])
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        source.group("P", [["v1"], ["v1"]])
        source.group("Q", [["v2"], ["v2"]])
        source.group("R", [["v0"], ["v0"]])  # finished late, on a label nobody observed before
        source.group("S", [["v2"]])
        final = decided(tail, ["P", "Q", "R", "S"])
    assert final == {"P": "dropped_retroactive", "Q": "kept", "R": "dropped_stale", "S": "kept"}
    r = next(x for x in tail.records if isinstance(x, DecisionRecord) and x.group_id == "R")
    assert (r.window.current_version, r.window.current_index, r.window.cutoff_index) == ("v2", 2, 2)
    source.close()
    tail.close()


def test_failed_groups_are_retried_then_dropped_and_never_move_the_window(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=1, max_retries=2)
    source = Source(settings, ["v0", "v1", "v2"])
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        retries = Tail(settings, settings.topics.retries)
        source.group("ok1", [["v1"], ["v1"]])
        source.group("f0", [["v2"], ["v2"]], prompt_id="pf", attempt=0, rejected=[1])  # v2 must not advance
        source.group("f2", [["v1"], ["v1"]], prompt_id="pf", attempt=2, rejected=[0])
        source.group("ok2", [["v1"]])
        final = decided(tail, ["ok1", "f0", "f2", "ok2"])
        got = retries.wait(lambda rs: len(rs) >= 1, "a retry request")
    assert final == {"ok1": "kept", "f0": "failed_retry", "f2": "failed_dropped", "ok2": "kept"}
    f0 = next(r for r in tail.records if isinstance(r, DecisionRecord) and r.group_id == "f0")
    assert f0.window.current_version == "v1"
    [retry] = distinct_retries(got)
    assert (retry.prompt_id, retry.attempt, retry.previous_group_id) == ("pf", 1, "f0")
    assert retry.prompt == {"id": "pf"}
    client = redis.Redis.from_url(settings.redis.url, decode_responses=True)
    assert WindowReader(client, RedisKeys(settings.redis.key_prefix)).window().drops_by_reason["failed_dropped"] == 1
    # a failed group's tokens (rejected sessions' included) are never trained, retried or not
    tally = WindowReader(client, RedisKeys(settings.redis.key_prefix)).window().tokens
    assert tally == TokenTally(generated=8 + 8 + 8 + 4, window=0, no_signal=0, failed=8 + 8)
    client.close()
    source.close()
    tail.close()
    retries.close()


def test_a_dependencys_failure_does_not_use_up_the_prompts_retries(kafka_bootstrap: str, redis_db_url: str) -> None:
    """On its last attempt, a group whose session failed because its agent went idle (a dependency,
    not the prompt) is retried with the same attempt and one more free retry; over the free cap, or
    failed for the prompt's own reason, the last attempt drops it as before."""
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=1, max_retries=2, max_free_retries=3)
    source = Source(settings, ["v0", "v1"])
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        retries = Tail(settings, settings.topics.retries)
        source.group("idle", [["v1"], ["v1"]], prompt_id="pa", attempt=2, rejected=[1], rejected_error="session_idle")
        source.group("capped", [["v1"]], prompt_id="pb", attempt=2, free_retries=3, rejected=[0],
                     rejected_error="incomplete")
        source.group("stale", [["v1"], ["v1"]], prompt_id="pc", attempt=2, rejected=[0, 1],
                     rejected_error="partial_rollout_staleness_exceeded")
        final = decided(tail, ["idle", "capped", "stale"])
        got = retries.wait(lambda rs: len(rs) >= 1, "a retry request")
    assert final == {"idle": "failed_retry", "capped": "failed_dropped", "stale": "failed_dropped"}
    [retry] = distinct_retries(got)
    assert (retry.prompt_id, retry.attempt, retry.free_retries, retry.previous_group_id) == ("pa", 2, 1, "idle")
    source.close()
    tail.close()
    retries.close()


def test_a_group_whose_session_never_ended_is_failed_after_the_incomplete_timeout_and_retried(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    """Its agent died before the proxy saw the session's end: the prompt is retried, not lost."""
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2, incomplete_timeout_s=2.0)
    source = Source(settings, ["v0", "v1"])
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        retries = Tail(settings, settings.topics.retries)
        records = group_records("cut", [["v1"], ["v1"]], prompt_id="pc")
        assert isinstance(records[-1], SessionFinished)
        source.records(records[:-1])  # the second session's end never comes
        source.group("ok", [["v1"]])
        final = decided(tail, ["cut", "ok"])
        got = retries.wait(lambda rs: len(rs) >= 1, "a retry request")
        audit = Tail(settings, settings.topics.groups)
        groups = audit.wait(lambda rs: len(rs) >= 2, "both groups audited")
    assert final == {"cut": "failed_retry", "ok": "kept"}
    # incomplete is not the prompt's fault: a free retry, the attempt is not used up
    assert [(r.prompt_id, r.attempt, r.free_retries, r.previous_group_id) for r in distinct_retries(got)] == [
        ("pc", 0, 1, "cut")
    ]
    [cut] = [g for g in groups if isinstance(g, CompletedGroup) and g.group_id == "cut"]
    assert [(t.status, t.error) for t in cut.trajectories] == [("completed", ""), ("rejected", "incomplete")]
    source.close()
    tail.close()
    retries.close()
    audit.close()


def test_manifests_reference_groups_and_report_window_drops_and_gaps(kafka_bootstrap: str, redis_db_url: str) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2, batch_groups=2)
    source = Source(settings, ["v0", "v1", "v2"])
    with Running(settings) as replica:
        batches = Tail(settings, settings.topics.batches)
        source.group("m1", [["v1"], ["v1"]])
        source.group("m2", [["v0"]])  # kept: cutoff 0 while current is v1
        source.group("m3", [["v2"]])  # advance: batch 0 was already taken, so nothing retro
        source.group("m4", [["v0"]])  # stale now
        source.group("m5", [["v2"], ["v1"]])
        records = batches.wait(lambda rs: len(manifests_by_index(rs)) >= 2, "two manifests")
        manifests = manifests_by_index(records)
        assert replica.metric("rein_collector_batches_total") == 2
        assert replica.metric("rein_staleness_dropped_groups_total", {"reason": "dropped_stale"}) == 1
        assert replica.metric("rein_staleness_decided_tokens_total", {"decision": "dropped_stale"}) == 4
        assert replica.metric("rein_staleness_decided_tokens_total", {"decision": "kept"}) == 24
        assert replica.metric("rein_staleness_current_version_index") == 2
        assert replica.metric("rein_staleness_cutoff_version_index") == 1
    first, second = manifests[0], manifests[1]
    assert [g.group_id for g in first.groups] == ["m1", "m2"]
    assert [g.group_id for g in second.groups] == ["m3", "m5"]
    assert first.version_gap is not None and (first.version_gap.min, first.version_gap.max) == (0, 1)
    assert second.window.current_version == "v2" and second.window.cutoff_index == 1
    assert second.dropped == [{"group_id": "m4", "decision": "dropped_stale"}]
    assert (second.drops_in_batch, second.drops_cumulative) == (1, 1)
    # 4 trainable tokens per trajectory: m1 8, m2 4 (first); m3 4, m4 4 (stale), m5 8
    assert (first.generated_tokens_cumulative, first.untrained_tokens_cumulative) == (
        12, {"window": 0, "no_signal": 0, "failed": 0, "withheld": 0}
    )
    assert (second.generated_tokens_cumulative, second.untrained_tokens_cumulative) == (
        28, {"window": 4, "no_signal": 0, "failed": 0, "withheld": 0}
    )
    assert second.version_gap is not None and (second.version_gap.min, second.version_gap.max) == (0, 1)
    assert second.batch_id.endswith("-batch-00000001") and second.index == 1
    for ref in first.groups + second.groups:
        group = read_at(settings.kafka, settings.topics.groups, ref.partition, ref.offset)
        assert isinstance(group, CompletedGroup) and group.group_id == ref.group_id
    source.close()
    batches.close()


def test_withhold_keeps_a_stale_groups_fresh_members_and_names_the_others_in_the_manifest(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2, batch_groups=2, stale_groups="withhold")
    source = Source(settings, ["v0", "v1", "v2", "v3"])
    with Running(settings):
        batches = Tail(settings, settings.topics.batches)
        decisions = Tail(settings, settings.topics.decisions)
        source.group("w1", [["v1"], ["v1"]])  # current v1: kept
        source.group("w2", [["v0"], ["v2"]])  # current v2, cutoff 1: w2-s0 (v0) withheld, w2-s1 kept -> batch 0
        source.group("w3", [["v1"], ["v2"]])  # inside [v1, v2]: kept, pending
        source.group("w4", [["v3"], ["v0"], ["v3"]])  # advance, cutoff 2: w3-s0 and w4-s1 withheld -> batch 1
        source.group("w5", [["v0"], ["v1"]])  # no member inside: dropped whole
        records = batches.wait(lambda rs: len(manifests_by_index(rs)) >= 2, "two manifests")
        assert decided(decisions, ["w1", "w2", "w3", "w4", "w5"]) == {
            "w1": "kept", "w2": "kept", "w3": "kept", "w4": "kept", "w5": "dropped_stale",
        }
        client = redis.Redis.from_url(settings.redis.url, decode_responses=True)
        tally = WindowReader(client, RedisKeys(settings.redis.key_prefix)).window().tokens
    first, second = manifests_by_index(records)[0], manifests_by_index(records)[1]
    assert [(g.group_id, g.withheld) for g in first.groups] == [("w1", []), ("w2", ["w2-s0"])]
    assert [(g.group_id, g.withheld) for g in second.groups] == [("w3", ["w3-s0"]), ("w4", ["w4-s1"])]
    assert second.version_gap is not None and second.version_gap.max == 1, "withheld members are not in the gap"
    # 4 trainable tokens per trajectory: three withheld, w5's two dropped
    assert tally == TokenTally(generated=11 * 4, window=8, withheld=12)
    assert second.untrained_tokens_cumulative == {"window": 0, "no_signal": 0, "failed": 0, "withheld": 12}
    source.close()
    batches.close()
    decisions.close()


def test_malformed_records_are_skipped_counted_and_the_collector_keeps_going(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2)
    settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"max_record_bytes": 20_000})})
    source = Source(settings, ["v0", "v1"])
    raw = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    poison = {
        "not_msgpack": b"\xc1\xc1garbage",
        "schema_version": msgpack.packb({"schema": 99, "type": "chunk", "data": {}}),
        "invalid_fields": msgpack.packb({"schema": 1, "type": "chunk", "data": {"seq": "x"}}),
        "oversize": b"\x00" * 30_000,
    }
    with Running(settings) as replica:
        tail = Tail(settings, settings.topics.decisions)
        source.group("before", [["v1"]])
        for topic in (settings.topics.chunks, settings.topics.events):
            for value in poison.values():
                raw.send(topic, key=b"poison", value=value)
        raw.flush(timeout=30)
        source.group("after", [["v1"], ["v1"]])
        final = decided(tail, ["before", "after"])
        # a valid record of a type the collector does not assemble is handled too (no stall)
        raw.send(settings.topics.events, key=b"x", value=encode(_retry()))
        raw.flush(timeout=30)
        source.group("later", [["v1"]])
        final = decided(tail, ["before", "after", "later"])
        for topic in (settings.topics.chunks, settings.topics.events):
            for reason in poison:
                labels = {"topic": topic, "reason": reason}
                assert replica.metric("rein_bus_decode_errors_total", labels) == 1, labels
    assert final == {"before": "kept", "after": "kept", "later": "kept"}
    raw.close()
    source.close()
    tail.close()


def _retry() -> RetryRequest:
    return RetryRequest(prompt_id="p", attempt=1, previous_group_id="g")


SIGNAL_STREAM: list[tuple[str, list[list[str | None]], dict[str, object]]] = [
    ("flat1", [["v0"], ["v0"]], {}),  # every trajectory got reward 1.0
    ("A", [["v0"], ["v0"]], {"rewards": [0.0, 1.0]}),
    ("solo", [["v1"]], {}),  # one trajectory is its own baseline; the first v1: it moves the window
    ("f", [["v1"], ["v1"]], {"rejected": [0], "rewards": [0.0, 0.0]}),  # failed: retried, whatever its rewards
    ("flat0", [["v1"], ["v1"]], {"rewards": [0.0, 0.0]}),
    ("B", [["v1"], ["v1"]], {"rewards": [1.0, 0.5]}),
]


@pytest.mark.parametrize(
    ("policy", "decisions", "batches"),
    [
        (
            "drop",
            {"flat1": "dropped_no_signal", "A": "kept", "solo": "dropped_no_signal", "f": "failed_retry",
             "flat0": "dropped_no_signal", "B": "kept"},
            [["A", "B"]],
        ),
        (  # today's behaviour: groups without signal fill batches
            "keep",
            {"flat1": "kept", "A": "kept", "solo": "kept", "f": "failed_retry", "flat0": "kept", "B": "kept"},
            [["flat1", "A"], ["solo", "flat0"]],
        ),
    ],
)
def test_groups_without_signal_are_dropped_counted_and_not_retried(
    kafka_bootstrap: str, redis_db_url: str, policy: str, decisions: dict[str, str], batches: list[list[str]]
) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2, batch_groups=2, no_signal_groups=policy)
    source = Source(settings, ["v0", "v1"])
    with Running(settings) as running:
        tail = Tail(settings, settings.topics.decisions)
        retries = Tail(settings, settings.topics.retries)
        manifests = Tail(settings, settings.topics.batches)
        for gid, trajs, kw in SIGNAL_STREAM:
            source.group(gid, trajs, **kw)
        final = decided(tail, [gid for gid, _, _ in SIGNAL_STREAM])
        wait_settled(settings, [tail, retries, manifests])  # every retry and manifest there is, is read
    assert final == decisions
    solo = next(r for r in tail.records if isinstance(r, DecisionRecord) and r.group_id == "solo")
    assert solo.window.current_version == "v1"  # observed before it was judged
    assert [(r.prompt_id, r.previous_group_id) for r in distinct_retries(retries.records)] == [("prompt-f", "f")]
    made = manifests_by_index(manifests.records)
    assert [[ref.group_id for ref in made[i].groups] for i in sorted(made)] == batches
    no_signal = 3  # flat1, solo, flat0; f failed and is judged as a failure
    if policy == "drop":
        assert made[0].dropped == [{"group_id": g, "decision": "dropped_no_signal"} for g in ("flat1", "solo", "flat0")]
        assert made[0].drops_cumulative == no_signal
    assert running.metric("rein_staleness_dropped_groups_total", {"reason": "dropped_no_signal"}) == (
        no_signal if policy == "drop" else 0
    )
    assert running.metric("rein_collector_no_signal_groups_total") == no_signal  # counted under either policy
    assert running.metric("rein_collector_no_signal_run") == 0  # B carried signal
    window = redis.Redis.from_url(settings.redis.url, decode_responses=True).hgetall(
        RedisKeys(settings.redis.key_prefix).window
    )
    assert int(window.get("drops:dropped_no_signal", 0)) == (no_signal if policy == "drop" else 0)
    assert window["no_signal_run"] == "0"
    flat_tokens = 8 + 4 + 8 if policy == "drop" else 0  # flat1, solo, flat0 (4 tokens a trajectory)
    assert decode_window(window).tokens == TokenTally(generated=44, window=0, no_signal=flat_tokens, failed=8)  # type: ignore[arg-type]
    if policy == "drop":
        assert made[0].untrained_tokens_cumulative == {
            "window": 0, "no_signal": flat_tokens, "failed": 8, "withheld": 0,
        }
    for t in (tail, retries, manifests):
        t.close()
    source.close()
