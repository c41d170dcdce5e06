"""Bounded state: the collector's ``decided`` marks are trimmed after a TTL that Kafka's retention
cannot outlive; the topology (partitions, retention, compaction) is what ``shared.topology`` says."""

from __future__ import annotations

import time

import pytest
import redis

from services.collector.service import Collector
from services.collector.window_store import WindowLost, WindowStore
from shared.bus import ensure_topology, topic_configs
from shared.names import RedisKeys, Topics
from shared.settings import KafkaSettings
from shared.staleness import WindowSettings
from shared.topology import DAY_MS, TopicSpec, topic_specs
from tests.support.collector import Running, Source, Tail, final_decisions, make_settings

pytestmark = [pytest.mark.integration]


def test_decided_marks_older_than_the_ttl_are_trimmed_and_recent_ones_kept(
    kafka_bootstrap: str, redis_db_url: str
) -> None:
    settings = make_settings(kafka_bootstrap, redis_db_url, keep_versions=2)
    source = Source(settings, ["v0", "v1"])
    ids = [f"g{i}" for i in range(6)]
    with Running(settings):
        tail = Tail(settings, settings.topics.decisions)
        for gid in ids:
            source.group(gid, [["v1"], ["v1"]])
        tail.wait(lambda rs: set(ids) <= set(final_decisions(rs)), "every group decided")
        tail.close()
    source.close()
    client = redis.Redis.from_url(redis_db_url, decode_responses=True)
    keys = RedisKeys(settings.redis.key_prefix)
    store = WindowStore(client, keys, settings.topics, WindowSettings(keep_versions=2, batch_groups=100, max_retries=2),
                        replica="test")
    try:
        assert client.hlen(keys.decided) == 6 and client.zcard(keys.decided_at) == 6
        ttl = 3600.0
        client.zadd(keys.decided_at, dict.fromkeys(ids[:4], time.time() - 2 * ttl))  # decided two TTLs ago
        assert store.trim_decided(ttl, limit=3) == 3  # bounded per call
        assert store.trim_decided(ttl) == 1
        assert store.trim_decided(ttl) == 0
        assert sorted(client.hkeys(keys.decided)) == ids[4:]
        assert sorted(client.zrange(keys.decided_at, 0, -1)) == ids[4:]
        assert store.decided(ids) == dict.fromkeys(ids[4:], "kept")
    finally:
        client.close()


def test_a_ttl_that_retention_could_outlive_is_refused_at_start(kafka_bootstrap: str, redis_db_url: str) -> None:
    """The proof of the TTL, enforced: chunks and events kept 7 days in 1-day segments can be read
    again for 8 days, so a 7-day TTL is refused (naming the setting) and a 9-day one starts."""
    short = make_settings(kafka_bootstrap, redis_db_url, decided_ttl_s=7 * 24 * 3600.0)
    with pytest.raises(RuntimeError, match=r"REIN_DECIDED_TTL_S \(604800 s\) does not outlive .*192 h"):
        Collector(short).run()
    with Running(make_settings(kafka_bootstrap, redis_db_url, decided_ttl_s=9 * 24 * 3600.0)) as replica:
        assert replica.error is None


def test_the_topology_is_created_as_specified(kafka_bootstrap: str, unique_topic: object) -> None:
    import uuid

    tag = uuid.uuid4().hex[:8]
    topics = Topics(**{name: f"t.topology.{name}.{tag}" for name in Topics.model_fields})
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    created = ensure_topology(kafka, topics, partitions=3)
    assert sorted(created) == sorted(topics.all())
    assert ensure_topology(kafka, topics, partitions=3) == []  # idempotent
    configs = topic_configs(kafka, topics.all())
    specs = topic_specs(topics, 3)
    for name, spec in specs.items():
        for key, value in spec.configs.items():
            assert configs[name][key] == value, (name, key)
    assert configs[topics.weights]["cleanup.policy"] == "compact" and configs[topics.weights]["retention.ms"] == "-1"
    assert TopicSpec(0, configs[topics.chunks]).deleted_within_ms() == 8 * DAY_MS
    assert TopicSpec(0, configs[topics.weights]).deleted_within_ms() is None
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap)
    try:
        assert consumer.partitions_for_topic(topics.weights) == {0}
        assert consumer.partitions_for_topic(topics.chunks) == {0, 1, 2}
    finally:
        consumer.close()


def test_a_window_under_the_old_untagged_keys_is_refused_not_restarted(redis_db_url: str) -> None:
    """Keys carry the prefix as a hash tag now; a window an older rein left under ``<prefix>:window:config``
    must stop the collector with a clear error instead of a fresh window whose manifests restart at 0."""
    client = redis.Redis.from_url(redis_db_url, decode_responses=True)
    keys = RedisKeys(f"old{time.monotonic_ns()}")
    store = WindowStore(client, keys, Topics(), WindowSettings(keep_versions=2, batch_groups=8, max_retries=2),
                        replica="test")
    try:
        client.hset(f"{keys.prefix}:window:config", mapping={"keep_versions": "2"})
        with pytest.raises(WindowLost, match="old key layout"):
            store.claim_config()
        assert not client.exists(keys.window_config), "nothing was claimed beside the old window"
        client.delete(f"{keys.prefix}:window:config")
        store.claim_config()  # without the old keys: a fresh window, as before
        assert client.exists(keys.window_config)
    finally:
        client.delete(keys.window_config)
        client.close()
