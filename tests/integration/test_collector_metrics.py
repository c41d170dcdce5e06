"""The collector's staleness metrics: pure helpers, then ``/metrics`` of a running collector.

Known sequence: group S (trajectories on v0 and on v0+v1: spans 1 and 2); groups R0 and R1,
two attempts of one prompt, each with a session rejected for
``partial_rollout_staleness_exceeded`` (2 trajectories each); group T rejected for another
reason (not counted).
"""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.collector.assembly import (
    PARTIAL_ROLLOUT_STALENESS,
    RecentSpans,
    SeenOnce,
    partial_rollout_rejected_samples,
    trajectory_version_span,
    version_spans,
)
from services.collector.synthetic import group_records
from shared.metrics import prom_name
from shared.schemas import CompletedGroup, Record, Segment, SessionRejected, Trajectory
from tests.integration.test_collector_support import Running, Source, Tail, final_decisions, make_settings

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning")]


def _traj(versions: list[str | None], status: str = "completed", error: str = "") -> Trajectory:
    n = len(versions)
    seg = Segment(segment_index=0, token_ids=list(range(n)), loss_mask=[1] * n, logprobs=[0.0] * n, versions=versions)
    return Trajectory(session_id="s", status=status, error=error, segments=[seg])  # type: ignore[arg-type]


def _group(trajectories: list[Trajectory], failed: bool) -> CompletedGroup:
    return CompletedGroup(group_id="g", prompt_id="p", failed=failed, trajectories=trajectories)


def test_span_counts_distinct_real_versions_over_all_tokens() -> None:
    assert trajectory_version_span(_traj([None, "v0", "v0", None, "v1", " v1 ", "unknown", "-1"])) == 2
    assert trajectory_version_span(_traj([None, None])) == 0
    ok = _group([_traj(["v0"]), _traj(["v0", "v1", "v2"]), _traj([None])], failed=False)
    assert version_spans(ok) == [1, 3]  # a trajectory without a real version gives no span
    assert version_spans(ok.model_copy(update={"failed": True})) == []


def test_partial_rollout_rejections_count_the_whole_group() -> None:
    hit = _traj(["v0"], "rejected", PARTIAL_ROLLOUT_STALENESS)
    assert partial_rollout_rejected_samples(_group([hit, _traj(["v0"]), _traj(["v0"])], failed=True)) == 3
    other = _traj(["v0"], "rejected", "generation_preempted")
    assert partial_rollout_rejected_samples(_group([other, _traj(["v0"])], failed=True)) == 0


def test_recent_spans_and_seen_once() -> None:
    spans = RecentSpans(size=3)
    assert spans.stats() is None
    spans.add([5, 1, 2])
    spans.add([3])  # 5 falls out
    stats = spans.stats()
    assert stats is not None and (stats.min, stats.max, stats.mean) == (1, 3, 2.0)
    seen = SeenOnce(size=2)
    assert [seen.add(k) for k in ("a", "a", "b", "c", "a")] == [True, False, True, True, True]


def _rejected(records: list[Record], error: str) -> list[Record]:
    return [r.model_copy(update={"error": error}) if isinstance(r, SessionRejected) else r for r in records]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def test_metrics_endpoint_exposes_staleness_metrics(kafka_bootstrap: str, redis_db_url: str) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2, batch_groups=100)
    source = Source(settings)
    try:
        source.weights(["v0", "v1"])
        with Running(settings) as running:
            tail = Tail(settings, settings.topics.decisions)
            source.group("S", [["v0"], ["v0", "v1"]])
            for attempt in (0, 1):
                source.records(
                    _rejected(
                        group_records(f"R{attempt}", [["v1"], ["v1"]], prompt_id="P", attempt=attempt, rejected=[0]),
                        PARTIAL_ROLLOUT_STALENESS,
                    )
                )
            source.records(_rejected(group_records("T", [["v1"], ["v1"]], rejected=[1]), "generation_preempted"))
            tail.wait(lambda rs: {"S", "R0", "R1", "T"} <= set(final_decisions(rs)), "decisions of S, R0, R1, T")
            tail.close()
            assert running.collector.http is not None
            values = _scrape(running.collector.http.port)
    finally:
        source.close()

    def value(name: str, suffix: str = "") -> float:
        return values[prom_name(name) + suffix]

    assert value("staleness/version_span_min") == 1
    assert value("staleness/version_span_max") == 2
    assert value("staleness/version_span_mean") == 1.5
    assert value("staleness/partial_rollout_rejected_groups", "_total") == 2  # attempts
    assert value("staleness/partial_rollout_rejected_samples", "_total") == 4  # 2 trajectories each
    assert value("staleness/partial_rollout_rejected_prompts", "_total") == 1  # one prompt
    # the existing ones are still there
    assert value("staleness/current_version_index") == 1
    assert value("staleness/cutoff_version_index") == 0
    assert prom_name("staleness/version_gap_mean") in values
