"""Rebalances are ordinary events: a foreign member joins a consumer's group mid-run and leaves again.

The foreign member (``tests/support/rebalance.py``) takes partitions and never commits,
so everything it read is read again by the consumer once it has left. Each consumer must
stay alive, lose nothing and do nothing twice. The rollout runner's and the broadcaster's
versions of this test live beside their stacks (``test_rollout_runner.py``,
``test_broadcaster_control_plane.py``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import KafkaProducer

from services.trainer.loop import RunResult, run
from shared.names import Topics
from shared.schemas import encode
from shared.settings import KafkaSettings
from tests.integration.test_collector_support import Running, Source, Tail, make_settings, manifests_by_index
from tests.integration.test_trainer_loop import Env, _manifest
from tests.support.rebalance import ForeignMember

pytestmark = [pytest.mark.integration]


def _wait(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)


def test_collector_member_joins_and_leaves(kafka_bootstrap: str, redis_db_url: str) -> None:
    settings = make_settings(
        kafka_bootstrap, redis_db_url, partitions=4, keep_versions=2, batch_groups=4, drain_interval_s=0.3
    )
    topics = settings.topics
    source = Source(settings)
    source.weights(["v0", "v1"])
    batches = Tail(settings, topics.batches)
    kept = [f"r{i:02d}" for i in range(48)]
    try:
        with Running(settings) as replica:
            for gid in kept[:16]:
                source.group(gid, [["v1"], ["v1"]])
            batches.wait(lambda rs: len(manifests_by_index(rs)) >= 4, "the first 16 groups in manifests")
            with ForeignMember(kafka_bootstrap, settings.group_id, [topics.chunks, topics.events]) as member:
                assert {t for t, _ in member.partitions} == {topics.chunks, topics.events}
                for gid in kept[16:32]:
                    source.group(gid, [["v1"], ["v1"]])
                _wait(lambda: member.records > 0, 30, "the foreign member to read records of its partitions")
                batches.wait(lambda rs: len(manifests_by_index(rs)) >= 5, "the replica deciding its own partitions")
            for gid in kept[32:]:
                source.group(gid, [["v1"], ["v1"]])
            batches.wait(lambda rs: len(manifests_by_index(rs)) >= 12, "every group in a manifest", 90)
            time.sleep(1.0)  # let a duplicate manifest surface before counting (there is no event for "none")
            manifests = manifests_by_index(batches.poll())
            rebalances = replica.collector.consumer.rebalances
            assert replica.thread.is_alive() and replica.error is None
    finally:
        source.close()
        batches.close()
    assert rebalances >= 2, "the join and the leave each revoke the replica's partitions"
    assert sorted(manifests) == list(range(12))
    in_batches = Counter(g.group_id for m in manifests.values() for g in m.groups)
    assert set(in_batches) == set(kept) and set(in_batches.values()) == {1}


def _produce_to(bootstrap: str, topic: str, partition: int, record: object) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        producer.send(topic, value=encode(record), partition=partition).get(timeout=30)  # type: ignore[arg-type]
    finally:
        producer.close(timeout=10)


def test_trainer_member_joins_and_leaves(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    topics = Topics(groups=unique_topic(4), batches=unique_topic(4), weights=unique_topic(4))
    env = Env(KafkaSettings(bootstrap_servers=kafka_bootstrap), topics, tmp_path, unique_group)
    refs = env.groups(16)
    manifests = [_manifest(i, refs[2 * i : 2 * i + 2]) for i in range(8)]
    env.manifests(manifests[:2])
    stop = threading.Event()
    results: list[RunResult] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            results.append(run(env.settings(max_steps=8, publish_every=1), stop))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="trainer-under-test", daemon=True)
    thread.start()
    try:
        _wait(lambda: len(env.lines()) >= 2 or errors, 90, "the first two steps")
        with ForeignMember(kafka_bootstrap, unique_group, [topics.batches]) as member:
            theirs = sorted(p for _, p in member.partitions)
            ours = sorted(set(range(4)) - set(theirs))
            assert theirs and ours
            # index 2 on the member's partition, 3 and 4 on the trainer's: it buffers them and waits
            _produce_to(kafka_bootstrap, topics.batches, theirs[0], manifests[2])
            for m in manifests[3:5]:
                _produce_to(kafka_bootstrap, topics.batches, ours[0], m)
            _wait(lambda: member.records > 0, 30, "the foreign member to read index 2")
            assert len(env.lines()) == 2 and not errors, "index 2 is held by the member: no step can follow"
        env.manifests(manifests[5:])
        thread.join(120)
        assert not thread.is_alive(), "the trainer did not finish its 8 steps"
    finally:
        stop.set()
        thread.join(30)
        env.close()
    assert not errors, errors
    [result] = results
    assert result.trained_indices == list(range(8))
    lines = env.lines()
    assert [x["manifest_index"] for x in lines] == list(range(8))
    assert [x["step"] for x in lines] == list(range(1, 9))
