"""The Kafka topology in one place: every topic has a spec, and the bounds the collector relies on."""

from __future__ import annotations

import pytest

from shared.names import Topics
from shared.topology import DAY_MS, TopicSpec, input_deleted_within_ms, topic_specs


def test_every_topic_has_a_spec_and_the_collector_inputs_are_co_partitioned() -> None:
    topics = Topics(chunks="c", events="e")
    specs = topic_specs(topics, partitions=6)
    assert set(specs) == set(topics.all())
    assert specs["c"].partitions == specs["e"].partitions == 6
    weights = specs[topics.weights]
    assert weights.partitions == 1 and weights.configs["cleanup.policy"] == "compact"
    assert weights.deleted_within_ms() is None  # the registry's rebuild source is never deleted
    for name, spec in specs.items():
        if name != topics.weights:
            assert spec.configs["cleanup.policy"] == "delete" and int(spec.configs["retention.ms"]) > 0, name


@pytest.mark.parametrize(
    ("configs", "bound"),
    [
        ({"retention.ms": str(7 * DAY_MS), "segment.ms": str(DAY_MS)}, 8 * DAY_MS),
        ({"retention.ms": str(7 * DAY_MS)}, 14 * DAY_MS),  # the broker's default segment.ms is 7 days
        ({"retention.ms": "-1"}, None),
        ({"retention.ms": str(DAY_MS), "cleanup.policy": "compact,delete"}, None),  # compaction keeps keys
    ],
)
def test_how_long_a_record_can_be_read(configs: dict[str, str], bound: int | None) -> None:
    assert TopicSpec(1, configs).deleted_within_ms() == bound


def test_the_collectors_default_ttl_outlives_its_inputs() -> None:
    from services.collector.settings import CollectorSettings

    bound = input_deleted_within_ms(Topics())
    assert bound is not None
    assert CollectorSettings.model_fields["decided_ttl_s"].default * 1000 > max(bound, 14 * DAY_MS)
