"""The collector's staleness metrics on ``/metrics`` of a running collector (the pure helpers behind
them are unit-tested in ``tests/unit/collector/test_assembly.py``).

Known sequence: group S (trajectories on v0 and on v0+v1: spans 1 and 2); groups R0 and R1,
two attempts of one prompt, each with a session rejected for
``partial_rollout_staleness_exceeded`` (2 trajectories each); group T rejected for another
reason (not counted).
"""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.collector.assembly import PARTIAL_ROLLOUT_STALENESS
from services.collector.synthetic import group_records
from shared.metrics import prom_name
from shared.schemas import Record, SessionRejected
from tests.support.collector import Running, Source, Tail, final_decisions, make_settings

pytestmark = [pytest.mark.integration]


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
