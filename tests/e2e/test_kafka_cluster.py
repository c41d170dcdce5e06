"""A three-broker Kafka cluster under a run: one broker killed mid-run, nothing lost, nothing trained twice.

The local stack (the processes ``make demo`` starts) on ``deploy/kafka.sh start DIR --brokers 3``:
three KRaft nodes (broker + controller each), every topic replicated 3 ways with
``min.insync.replicas=2`` from the brokers' defaults, producers with ``acks=all``. After the first
step, the broker leading the ``weights`` partition (the control log every service follows) is
SIGKILLed; training must go on with two brokers, then go on again once it is back. The run is read
back from the topics and Redis as in ``test_faults.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from ops.local.stack import start
from shared.bus import new_client, topic_configs
from shared.names import Topics
from shared.schemas import WeightPublished
from shared.settings import KafkaSettings
from tests.support.fault_runs import PROGRESS_TIMEOUT_S, assert_nothing_lost_or_trained_twice, wait_trained
from tests.support.readback import batches_made, small_stack, stop_and_read, trained_index
from tests.support.wait import wait_on_stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]


def _partitions(bootstrap: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Every topic partition's metadata. Read again while a node is not ready (the cluster just started,
    or a broker is down, on a loaded machine): the question is what the cluster says, not how soon."""
    def read() -> dict[tuple[str, int], dict[str, Any]] | None:
        try:
            admin = new_client(lambda: KafkaAdminClient(bootstrap_servers=bootstrap.split(","),
                                                        request_timeout_ms=10_000))
        except KafkaError:
            return None
        try:
            return {(t["topic"], p["partition"]): p
                    for t in admin.describe_topics(Topics().all()) for p in t["partitions"]}
        except KafkaError:
            return None
        finally:
            admin.close()

    found: dict[tuple[str, int], dict[str, Any]] = wait_until(read, 90, "the cluster's partition metadata",
                                                               interval_s=1.0)
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    local = start(small_stack(tmp_path_factory.mktemp("cluster"), kafka_brokers=3))
    bootstrap = local.infra.kafka_bootstrap
    try:
        partitions = _partitions(bootstrap)
        configs = topic_configs(KafkaSettings(bootstrap_servers=bootstrap), Topics().all())
        wait_on_stack("trainer step 1", lambda: trained_index(local) >= 0, PROGRESS_TIMEOUT_S, local)
        victim = int(_partitions(bootstrap)[(Topics().weights, 0)]["leader"])
        phases = []
        for phase in ("killed", "back"):
            made, t0 = batches_made(local), time.monotonic()
            if phase == "killed":
                local.infra.kill_broker(victim)
            else:
                local.infra.restart("kafka", kill=False, broker=victim)
            wait_trained(local, made, f"a batch made after the broker was {phase}")
            # The leader moves once the controller fences the dead broker (broker.session.timeout.ms, 9 s),
            # which may come after the batch above: wait for it rather than read it once.
            def led(p: str = phase) -> int | None:
                now = int(_partitions(bootstrap)[(Topics().weights, 0)]["leader"])
                return now if p == "back" or now not in (victim, -1) else None

            leader = wait_until(led, 60, f"the weights leader after the broker was {phase}", interval_s=0.5)
            phases.append({"phase": phase, "trained_after_s": round(time.monotonic() - t0, 1),
                           "weights_leader": leader})
        after = _partitions(bootstrap)
        data = {**stop_and_read(local), "partitions": partitions, "configs": configs, "victim": victim,
                "phases": phases, "after": after}
        print(f"\nkafka cluster: broker {victim} (the weights leader) killed, then back: {phases}; "
              f"{len(data['rows'])} steps in all")
    finally:
        local.stop()
    return data


def test_every_topic_is_replicated_three_ways_with_two_in_sync_required(run: dict[str, Any]) -> None:
    assert run["partitions"], "no partitions described"
    for (topic, partition), p in run["partitions"].items():
        assert len(p["replicas"]) == 3 and len(p["isr"]) == 3, (topic, partition, p)
    for topic, config in run["configs"].items():
        assert config["min.insync.replicas"] == "2", (topic, config["min.insync.replicas"])


def test_training_went_on_with_a_broker_down_and_after_it_came_back(run: dict[str, Any]) -> None:
    assert [p["phase"] for p in run["phases"]] == ["killed", "back"]
    assert run["phases"][0]["weights_leader"] not in (run["victim"], -1), "the weights partition did not move"
    leader = run["after"][(Topics().weights, 0)]["leader"]
    assert leader >= 0, "the weights partition has no leader after the broker came back"


def test_nothing_lost_and_nothing_trained_twice(run: dict[str, Any]) -> None:
    assert len(run["rows"]) >= 3
    assert_nothing_lost_or_trained_twice(run)
    digests: dict[str, set[str]] = {}
    for record in run["weights"]:
        if isinstance(record, WeightPublished):
            digests.setdefault(record.version, set()).add(record.digest)
    assert len(digests) >= 3 and all(len(d) == 1 for d in digests.values()), digests
