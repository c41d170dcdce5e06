"""The version registry on a real Redis: rein's server-side scripts order, dedupe and refuse conflicts."""

from __future__ import annotations

import uuid

import pytest

from shared.names import RedisKeys
from shared.settings import RedisSettings
from shared.state import RedisRegistry, Replication, StateUnavailable, connect

pytestmark = pytest.mark.integration


def test_registry_orders_by_sequence_is_idempotent_and_refuses_conflicts(redis_db_url: str) -> None:
    client = connect(RedisSettings(url=redis_db_url))
    try:
        registry = RedisRegistry(client, RedisKeys(f"t{uuid.uuid4().hex[:8]}"))
        assert registry.observe(["v1"]) == [0]  # seen before it is published: indexed after the published
        assert registry.unregistered() == ["v1"]
        assert registry.publish("v1", 1) is True
        assert registry.publish("v0", 0) is True  # arrives late, sorts first
        assert registry.publish("v1", 1) is False  # the same pair again: nothing to do
        with pytest.raises(ValueError, match="already published with sequence 1"):
            registry.publish("v1", 2)
        with pytest.raises(ValueError, match="already used by version v0"):
            registry.publish("v9", 0)
        assert registry.ordered() == [("v0", 0), ("v1", 1)]
        assert registry.unregistered() == []
        assert registry.observe(["v1", "v0", "new"]) == [1, 0, 2]
        assert registry.count() == 2
    finally:
        client.close()


def test_a_write_no_replica_acknowledges_is_an_outage_not_a_success(redis_db_url: str) -> None:
    """The session's Redis has no replica: waiting for one must fail within its bound, as a dependency
    error the services' loops retry, instead of letting a window step be acted on unreplicated."""
    client = connect(RedisSettings(url=redis_db_url))
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    try:
        Replication().wait(client, keys)  # 0 replicas asked: nothing to wait for, nothing written
        assert client.get(keys.replicated) is None
        registry = RedisRegistry(client, keys, Replication(replicas=1, timeout_s=0.2))
        with pytest.raises(StateUnavailable, match="0 of 1 Redis replicas"):
            registry.publish("v0", 0)
        assert registry.ordered() == [("v0", 0)]  # written on the primary; a retry is idempotent
        assert client.get(keys.replicated) == "1"
    finally:
        client.close()
