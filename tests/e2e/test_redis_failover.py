"""Redis that survives its primary: a Sentinel failover mid-run, no window decision lost or taken twice.

The local stack (the processes ``make demo`` starts) on ``deploy/redis.sh start DIR --failover``: a
primary, two replicas and three Sentinels. Every service finds the primary through the Sentinels
(``REIN_REDIS__SENTINELS``) and acts on a window step or a registry entry only once a replica holds it
(``REIN_REDIS__REPLICAS_ACKED=1``, Redis WAIT). After the first step the primary is SIGKILLed; the
Sentinels promote a replica, the services reconnect to it, and training goes on. Read back from the
topics and the new primary: every completed group decided, each by one window step; every manifest
trained once; no group in two manifests; the registry equal to the ``weights`` topic.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pytest
from redis.exceptions import RedisError

from ops.local.stack import LocalStack, start
from shared.bus import read_topic
from shared.names import Topics
from shared.schemas import CompletedGroup, DecisionRecord
from shared.settings import KafkaSettings
from shared.state import client_for
from tests.support.fault_runs import (
    PROGRESS_TIMEOUT_S,
    assert_nothing_lost_or_trained_twice,
    assert_registry_matches_weights,
    wait_trained,
)
from tests.support.readback import batches_made, small_stack, stop_and_read, trained_index
from tests.support.wait import wait_on_stack

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]


def _primary(local: LocalStack) -> tuple[str, int] | None:
    """The primary the Sentinels name now (None while none is named)."""
    client = client_for(local.infra.redis_settings())
    try:
        address: tuple[str, int] = client.connection_pool.get_master_address()  # type: ignore[attr-defined]
        return address
    except RedisError:
        return None
    finally:
        client.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    local = start(small_stack(tmp_path_factory.mktemp("failover"), redis_failover=True))
    try:
        wait_on_stack("trainer step 1", lambda: trained_index(local) >= 0, PROGRESS_TIMEOUT_S, local)
        before = _primary(local)
        assert before is not None
        t0 = time.monotonic()
        local.infra.kill_redis_primary()
        # A batch made before the kill can still train after it: only a batch made once a replica is the
        # primary shows that the window goes on there.
        wait_on_stack("the Sentinels to promote a replica", lambda: _primary(local) not in (None, before),
                      PROGRESS_TIMEOUT_S, local)
        after = _primary(local)
        promoted_s = round(time.monotonic() - t0, 1)
        wait_trained(local, batches_made(local), "a batch made on the promoted primary")
        recovered_s = round(time.monotonic() - t0, 1)
        data = stop_and_read(local)
        kafka = KafkaSettings(bootstrap_servers=local.infra.kafka_bootstrap)
        completed = {r.group_id for r in read_topic(kafka, Topics().groups, 60) if isinstance(r, CompletedGroup)}
        print(f"\nredis failover: primary {before} killed, {after} promoted {promoted_s} s later; a batch made on "
              f"it trained {recovered_s} s after the kill; {len(data['rows'])} steps, {len(completed)} groups")
        data |= {"before": before, "after": after, "completed": completed, "recovered_s": recovered_s}
    finally:
        local.stop()
    return data


def test_a_replica_was_promoted_and_training_went_on(run: dict[str, Any]) -> None:
    assert run["after"] != run["before"], "the Sentinels did not promote a replica"
    assert len(run["rows"]) >= 2


def test_no_window_decision_lost_or_taken_twice(run: dict[str, Any]) -> None:
    steps: dict[str, set[int | None]] = defaultdict(set)
    for d in run["decisions"]:
        if isinstance(d, DecisionRecord) and d.decision != "dropped_retroactive":
            steps[d.group_id].add(d.step)
    undecided = sorted(run["completed"] - set(steps))
    assert not undecided, f"{len(undecided)} completed groups without a decision: {undecided[:5]}"
    twice = {g: sorted(s, key=str) for g, s in steps.items() if len(s) > 1}
    assert not twice, f"groups decided by two window steps: {twice}"


def test_nothing_trained_twice_and_the_registry_matches_the_topic(run: dict[str, Any]) -> None:
    assert_nothing_lost_or_trained_twice(run)
    assert_registry_matches_weights(run)
