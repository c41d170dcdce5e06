"""The rollout runner end to end: real engine, real proxy, real Kafka, the runner as a process.

One engine and one proxy subprocess per module, on fresh topics. Each test runs
``python -m services.rollout`` with ``REIN_MAX_GROUPS`` so it exits by itself, then
reads every record back and checks it against the task: the runner's rewards must be
exactly what the task computes for the transcript the chunks record.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient

from ops.local.ports import free_port
from services.rollout.task import NumberGuessTask
from shared.bus import create_topics
from shared.names import RedisKeys, Topics
from shared.schemas import BatchSkipped, GroupDispatched, Record, RetryRequest, WeightApplied
from tests.support.kafka_io import produce
from tests.support.rebalance import ForeignMember
from tests.support.rollout_runner import (
    RunnerStack,
    check_groups,
    dispatched_groups,
    pacing_held,
    runner_env,
    runner_health,
    running,
    start_runner,
    wait_exit,
    wait_for,
)
from tests.support.stack import engine_and_proxy

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(
    kafka_bootstrap: str, kafka_admin: KafkaAdminClient, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunnerStack]:
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(chunks=f"t.rollout.chunks.{suffix}", events=f"t.rollout.events.{suffix}")
    names = [topics.chunks, topics.events]
    create_topics(kafka_admin, dict.fromkeys(names, 4))
    logs = tmp_path_factory.mktemp("rollout-logs")
    with engine_and_proxy(
        kafka_bootstrap, topics, tmp_path_factory.mktemp("weights"), logs,
        admin_token="rollout-test-token", engine_env={"REIN_SEED": "3"},
    ) as (_engine, proxy):
        yield RunnerStack(kafka_bootstrap, topics, proxy.url, logs, redis_url, proxy.runner_token)


def test_two_groups_of_four(stack: RunnerStack, unique_group: str, unique_topic: Callable[..., str]) -> None:
    before = {g.group_id for g in dispatched_groups(stack)}
    env = runner_env(stack, unique_group, unique_topic(), unique_topic(), REIN_MAX_GROUPS="2", REIN_SEED="5")
    proc, log_path = start_runner(stack, env)
    wait_exit(proc, log_path)
    new = [g for g in dispatched_groups(stack) if g.group_id not in before]
    prompts = NumberGuessTask().prompts(5)
    expected = [next(prompts), next(prompts)]
    assert sorted((g.prompt_id, g.attempt) for g in new) == sorted((p.prompt_id, 0) for p in expected)
    assert {g.prompt_id: g.prompt for g in new} == {p.prompt_id: p.payload for p in expected}
    check_groups(stack, new)


def test_a_restarted_runner_continues_its_prompt_stream(
    stack: RunnerStack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    """The prompt cursor is durable: a second run with the same seed (a restart) dispatches the next
    prompts of the stream, never one of the first run's."""
    before = {g.group_id for g in dispatched_groups(stack)}
    env = runner_env(stack, unique_group, unique_topic(), unique_topic(), REIN_MAX_GROUPS="2", REIN_SEED="11")
    for _ in range(2):
        proc, log_path = start_runner(stack, env)
        wait_exit(proc, log_path)
    new = [g for g in dispatched_groups(stack) if g.group_id not in before]
    prompts = NumberGuessTask().prompts(11)
    expected = [next(prompts).prompt_id for _ in range(4)]
    assert sorted(g.prompt_id for g in new) == sorted(expected)
    assert all(g.attempt == 0 for g in new)


def test_retry_request_is_dispatched_first_with_its_attempt(
    stack: RunnerStack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    retries = unique_topic()
    before = {g.group_id for g in dispatched_groups(stack)}
    payload = {"task": "guess_number", "secret": 9, "low": 0, "high": 15, "max_turns": 5}
    retry = RetryRequest(
        prompt_id=f"gn-retry-{uuid.uuid4().hex[:6]}", attempt=2, previous_group_id="g-old", prompt=payload
    )
    partition, offset = produce(stack.bootstrap, retries, retry)
    env = runner_env(stack, unique_group, retries, unique_topic(), REIN_MAX_GROUPS="2", REIN_SEED="6")
    proc, log_path = start_runner(stack, env)
    wait_exit(proc, log_path)
    new = [g for g in dispatched_groups(stack) if g.group_id not in before]
    assert len(new) == 2
    first = new[0]
    assert (first.prompt_id, first.attempt, first.prompt) == (retry.prompt_id, 2, payload), "retry has priority"
    assert new[1].attempt == 0
    check_groups(stack, new)
    # The retry's offset was committed once its group was dispatched.
    reader = KafkaConsumer(bootstrap_servers=stack.bootstrap, group_id=unique_group, enable_auto_commit=False)
    try:
        assert reader.committed(TopicPartition(retries, partition)) == offset + 1
    finally:
        reader.close()


@pytest.mark.parametrize("release", ["weight_applied", "batch_skipped"])
def test_sync_mode_waits_for_a_new_weight_version(
    stack: RunnerStack, unique_group: str, unique_topic: Callable[..., str], release: str
) -> None:
    """The next wave opens on a new applied version, or on a batch the trainer consumed without one."""
    before = {g.group_id for g in dispatched_groups(stack)}
    port, weights = free_port(), unique_topic()
    env = runner_env(
        stack,
        unique_group,
        unique_topic(),
        weights,
        REIN_MAX_GROUPS="2",
        REIN_SEED="7",
        REIN_MODE="sync",
        REIN_GROUPS_PER_STEP="1",
        REIN_METRICS_PORT=str(port),
    )
    with running(stack, env) as (proc, log_path):

        def waiting() -> dict[str, Any] | None:
            body = runner_health(port)
            return body if body and body.get("waiting_for_weights") else None

        state = wait_for(waiting, 60, "the runner to wait for weights after its first wave")
        assert (state["dispatched"], state["in_flight"]) == (1, 0)
        assert len([g for g in dispatched_groups(stack) if g.group_id not in before]) == 1
        opens: Record = (
            WeightApplied(version="v-test", seq=state["weights_seq"] + 1, digest="d") if release == "weight_applied"
            else BatchSkipped(index=0, batch_id="b-test", reason="no_signal", version="v0")
        )
        produce(stack.bootstrap, weights, opens)
        wait_exit(proc, log_path)
    new = [g for g in dispatched_groups(stack) if g.group_id not in before]
    assert len(new) == 2
    check_groups(stack, new)


def test_async_pacing_starts_prompts_only_while_the_window_can_train_them(
    stack: RunnerStack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    """keep_versions 1, batch_groups 2: two prompts start, then nothing until the trainer's progress
    (a WeightApplied's last_index, a BatchSkipped) or a final drop frees places; retries are not paced."""
    before = {g.group_id for g in dispatched_groups(stack)}
    port, weights, retries = free_port(), unique_topic(), unique_topic()
    keys = RedisKeys(f"t-{unique_group}")
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    client.hset(keys.window_config, mapping={"keep_versions": "1", "batch_groups": "2", "max_retries": "2",
                                             "max_free_retries": "10"})
    env = runner_env(stack, unique_group, retries, weights, REIN_MAX_GROUPS="7", REIN_SEED="13",
                      REIN_METRICS_PORT=str(port))

    def settled(dispatched: int) -> Callable[[], dict[str, Any] | None]:
        def check() -> dict[str, Any] | None:
            body = runner_health(port)
            return body if body and body["dispatched"] == dispatched and body["in_flight"] == 0 else None
        return check

    def new() -> list[GroupDispatched]:
        return [g for g in dispatched_groups(stack) if g.group_id not in before]

    try:
        with running(stack, env) as (proc, log_path):
            state = wait_for(settled(2), 60, "the first two groups to end")
            assert state["pacing"] == {"live": 2, "capacity": 2, "consumed_index": -1}
            wait_for(lambda: pacing_held(port), 10, "the pacing gauge to say held")
            assert len(new()) == 2  # held: nothing more starts while the trainer has consumed nothing
            produce(stack.bootstrap, weights, WeightApplied(version="v-1", seq=1, digest="d", last_index=0))
            wait_for(settled(4), 60, "two more groups after batch 0 was consumed")
            produce(stack.bootstrap, weights, BatchSkipped(index=1, batch_id="b-1", reason="no_signal", version="v-1"))
            wait_for(settled(6), 60, "two more groups after batch 1 was skipped")
            client.hset(keys.window, "drops_total", "1")  # the window dropped one prompt for good
            # The seventh group is the last (REIN_MAX_GROUPS): the runner exits after it, so its health
            # may be gone before a poll sees it settled; the exit is what to await (then 7 groups below).
            wait_exit(proc, log_path, timeout_s=60)
    finally:
        client.close()
    groups = new()
    assert len(groups) == 7 and all(g.attempt == 0 for g in groups)
    check_groups(stack, groups)


def test_sigterm_drains_in_flight_groups_and_exits_zero(
    stack: RunnerStack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    before = {g.group_id for g in dispatched_groups(stack)}
    port = free_port()
    env = runner_env(
        stack,
        unique_group,
        unique_topic(),
        unique_topic(),
        REIN_SEED="8",
        REIN_MAX_CONCURRENT_GROUPS="2",
        REIN_METRICS_PORT=str(port),
    )
    with running(stack, env) as (proc, log_path):
        wait_for(lambda: int((runner_health(port) or {}).get("dispatched", 0)) >= 3, 60,
                  "the unbounded runner to dispatch a few groups")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert "rein_rollout_groups_in_flight" in metrics and "rein_rollout_episodes_total" in metrics
        proc.terminate()
        wait_exit(proc, log_path, timeout_s=60)
    new = [g for g in dispatched_groups(stack) if g.group_id not in before]
    assert len(new) >= 3
    check_groups(stack, new)  # every dispatched group ran to its end before the exit


N_RETRIES = 60


def test_retry_group_rebalances_lose_and_repeat_no_retry(
    stack: RunnerStack, unique_group: str, unique_topic: Callable[..., str]
) -> None:
    """A make-test failure once: retries queued in the runner while its retry group rebalances.

    Sixty retries, fifteen per partition, dispatched one group at a time (about 0.2 s each, so
    the queue outlasts a rebalance); a foreign member joins the runner's group while retries are
    queued (the runner's partitions are revoked and given back, so queued retries are delivered
    again) and leaves (they move once more). The runner must stay alive, dispatch every retry
    exactly once, and commit every retry record."""
    retries = unique_topic(4)
    before = {g.group_id for g in dispatched_groups(stack)}
    payload = {"task": "guess_number", "secret": 9, "low": 0, "high": 15, "max_turns": 5}
    tag = uuid.uuid4().hex[:6]
    wanted = []
    for i in range(N_RETRIES):
        retry = RetryRequest(prompt_id=f"rb-{tag}-{i}", attempt=1, previous_group_id="g-old", prompt=payload)
        produce(stack.bootstrap, retries, retry, partition=i % 4)
        wanted.append(retry.prompt_id)
    port = free_port()
    env = runner_env(stack, unique_group, retries, unique_topic(), REIN_SEED="9",
                      REIN_MAX_CONCURRENT_GROUPS="1", REIN_METRICS_PORT=str(port))
    with running(stack, env) as (proc, log_path):

        def health() -> dict[str, Any]:
            body = runner_health(port)
            if body is None:
                return {}
            assert proc.poll() is None, f"runner died; log:\n{log_path.read_text()[-4000:]}"
            return body

        def retries_dispatched() -> Counter[str]:
            assert proc.poll() is None, f"runner died; log:\n{log_path.read_text()[-4000:]}"
            return Counter(g.prompt_id for g in dispatched_groups(stack) if g.group_id not in before and g.attempt == 1)

        wait_for(lambda: health().get("dispatched", 0) >= 1 and health().get("pending_retries", 0) >= 4, 90,
                  "a retry dispatched while others are queued")
        with ForeignMember(stack.bootstrap, unique_group, [retries]) as member:
            wait_for(lambda: member.records > 0 or len(retries_dispatched()) == N_RETRIES, 30,
                      "the foreign member to read retries of its partitions")
        wait_for(lambda: len(retries_dispatched()) == N_RETRIES, 180, "every retry dispatched")
        assert proc.poll() is None, f"runner died; log:\n{log_path.read_text()[-4000:]}"

        def all_committed() -> bool:
            reader = KafkaConsumer(bootstrap_servers=stack.bootstrap, group_id=unique_group,
                                   enable_auto_commit=False)
            try:
                tps = [TopicPartition(retries, p) for p in range(4)]
                return all(reader.committed(tp) == N_RETRIES // 4 for tp in tps)
            finally:
                reader.close()

        wait_for(all_committed, 30, "every retry record committed")
        proc.terminate()
        wait_exit(proc, log_path, timeout_s=60)
    dispatched = Counter(g.prompt_id for g in dispatched_groups(stack) if g.group_id not in before and g.attempt == 1)
    assert dispatched == Counter(dict.fromkeys(wanted, 1)), "each retry dispatched exactly once"
    log_text = log_path.read_text()
    assert "retries_revoked" in log_text, "the runner's retry partitions were revoked at least once"
