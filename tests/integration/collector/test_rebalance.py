"""Rebalances are ordinary events: a foreign member joins the collector's group mid-run and leaves again.

The foreign member (``tests/support/rebalance.py``) takes partitions and never commits,
so everything it read is read again by the collector once it has left. The replica must
stay alive, lose nothing and do nothing twice. The other consumers' versions of this test
live beside their stacks (``tests/integration/{trainer/test_loop,rollout/test_runner,
broadcaster/test_control_plane}.py``).
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.support.collector import Running, Source, Tail, make_settings, manifests_by_index, wait_settled
from tests.support.rebalance import ForeignMember
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]


def test_collector_member_joins_and_leaves(kafka_bootstrap: str, redis_db_url: str) -> None:
    settings = make_settings(
        kafka_bootstrap, redis_db_url, partitions=4, keep_versions=2, batch_groups=4, drain_interval_s=0.3
    )
    topics = settings.topics
    source = Source(settings, ["v0", "v1"])
    batches = Tail(settings, topics.batches)
    kept = [f"r{i:02d}" for i in range(48)]
    try:
        with Running(settings) as replica:
            for gid in kept[:16]:
                source.group(gid, [["v1"], ["v1"]])
            batches.wait(lambda rs: len(manifests_by_index(rs)) >= 4, "the first 16 groups in manifests")
            with ForeignMember(kafka_bootstrap, settings.consumer_group, [topics.chunks, topics.events]) as member:
                assert {t for t, _ in member.partitions} == {topics.chunks, topics.events}
                for gid in kept[16:32]:
                    source.group(gid, [["v1"], ["v1"]])
                wait_until(lambda: member.records > 0, 30, "the foreign member to read records of its partitions")
                batches.wait(lambda rs: len(manifests_by_index(rs)) >= 5, "the replica deciding its own partitions")
            for gid in kept[32:]:
                source.group(gid, [["v1"], ["v1"]])
            batches.wait(lambda rs: len(manifests_by_index(rs)) >= 12, "every group in a manifest", 90)
            wait_settled(settings, [batches])  # any duplicate manifest is on the tail now
            manifests = manifests_by_index(batches.records)
            rebalances = replica.collector.consumer.rebalances
            assert replica.thread.is_alive() and replica.error is None
    finally:
        source.close()
        batches.close()
    assert rebalances >= 2, "the join and the leave each revoke the replica's partitions"
    assert sorted(manifests) == list(range(12))
    in_batches = Counter(g.group_id for m in manifests.values() for g in m.groups)
    assert set(in_batches) == set(kept) and set(in_batches.values()) == {1}
