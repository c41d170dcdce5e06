"""The version registry on a real Redis: rein's server-side scripts order, dedupe and refuse conflicts; the wait
for replicas on a primary with two."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path

import pytest

from ops.local.launcher import deploy_script
from services.collector.outbox import Outbox
from shared.bus import Delivered
from shared.names import RedisKeys
from shared.schemas import Record, RetryRequest
from shared.settings import RedisSettings
from shared.state import RedisRegistry, Replication, StateUnavailable, connect, in_sync_replicas
from tests.support.wait import wait_until

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


def test_every_replica_in_sync_must_hold_a_write_and_a_lost_one_is_not_waited_for(tmp_path: Path) -> None:
    """A primary and two replicas (``deploy/redis.sh start --failover``). Sentinel may promote either replica,
    so a write one of them holds is not safe yet: with the other stalled (SIGSTOP, still in sync for the
    primary) the wait fails, and the outbox publishes nothing. Once the stalled one is gone (SIGKILL) the
    survivor is enough: one lost replica does not stop writes."""
    started = deploy_script("redis.sh", "start", str(tmp_path / "redis"), "--failover")
    replicas = [int((tmp_path / "redis" / f"replica-{i}" / "redis.pid").read_text()) for i in (1, 2)]
    client = connect(RedisSettings(url=started["url"]))
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    # A wait that must succeed gets the services' bound: on a loaded machine (a CI run's four workers) a replica
    # once took over 0.5 s to acknowledge, and the healthy wait failed. A wait that must fail gets a short one:
    # the stalled replica never answers, so the bound only sets how long the test waits.
    replication, stalled = Replication(replicas=1, timeout_s=2.0), Replication(replicas=1, timeout_s=0.5)
    try:
        assert in_sync_replicas(client) == 2
        replication.wait(client, keys)
        os.kill(replicas[0], signal.SIGSTOP)
        with pytest.raises(StateUnavailable, match="1 of 2 Redis replicas"):
            stalled.wait(client, keys)
        outbox = Outbox(client, keys, replica="r", replication=stalled)
        with client.pipeline(transaction=True) as pipe:
            outbox.push(pipe, [("decisions", RetryRequest(prompt_id="p", attempt=1, previous_group_id="g"))])
            pipe.execute()
        sent: list[object] = []

        def publish(items: list[tuple[str, Record]]) -> list[Delivered]:
            sent.extend(items)
            return []

        with pytest.raises(StateUnavailable):
            outbox.drain(publish)
        assert sent == [] and client.llen(keys.outbox) == 1
        os.kill(replicas[0], signal.SIGKILL)
        wait_until(lambda: in_sync_replicas(client) == 1, 10, "the primary to drop the killed replica")
        replication.wait(client, keys)
        outbox = Outbox(client, keys, replica="r", replication=replication)
        assert outbox.drain(publish) == 1
        assert len(sent) == 1
    finally:
        for pid in replicas:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        client.close()
        deploy_script("redis.sh", "stop", str(tmp_path / "redis"), timeout_s=60)
