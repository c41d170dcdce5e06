"""The weight broadcaster with a real engine and a real proxy (subprocesses), Kafka and Redis.

- A ``WeightPublished`` on the weights topic ends with the engine serving the checkpoint
  (its ``/get_model_info`` digest is the event's), the version in the Redis registry, the
  proxy resumed and a ``WeightApplied`` on the topic.
- A proxy whose pause cannot quiesce (a slow generation in flight, a tiny pause timeout)
  gets no weight update; the failed round is counted and the proxy is resumed.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from ops.local.ports import free_port
from services.weight_broadcaster.service import run
from services.weight_broadcaster.settings import BroadcasterSettings
from shared import checkpoint
from shared.bus import Consumer, Producer, read_topic
from shared.codec import encode
from shared.names import RedisKeys, Topics
from shared.policy import PolicyConfig, init_policy
from shared.schemas import WeightApplied, WeightPublished
from shared.settings import KafkaSettings, RedisSettings, load
from shared.state import RedisRegistry, connect
from shared.tokenizer import TOKENIZER
from tests.support.procs import start_service
from tests.support.rebalance import ForeignMember
from tests.support.stack import engine_and_proxy
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.integration,
]

ADMIN = "broadcaster-test-token"
CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size)


@dataclass
class Stack:
    engine: str
    proxy: str
    weights_dir: Path
    kafka: KafkaSettings
    redis: RedisSettings
    topics: Topics
    group: str
    runner_token: str

    def runner(self, session_id: str) -> dict[str, str]:
        """Headers of the runner's call in session ``session_id``."""
        return {"X-Session-Id": session_id, "Authorization": f"Bearer {self.runner_token}"}

    def model_info(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.engine}/get_model_info", timeout=10).json()
        return data

    def proxy_state(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(
            f"{self.proxy}/v1/rollout/state", timeout=10, headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()
        return data

    def checkpoint(self, step: int) -> WeightPublished:
        path = (self.weights_dir / f"v{step}.pt").resolve()
        digest = checkpoint.save(path, init_policy(CFG, step), CFG, f"v{step}", step)
        return WeightPublished(version=f"v{step}", seq=step, path=str(path), digest=digest, step=step,
                               last_index=step + 2)

    def publish(self, event: WeightPublished) -> None:
        producer = Producer(self.kafka, client_suffix="test")
        try:
            producer.send(self.topics.weights, event)
        finally:
            producer.close()

    def applied(self, timeout_s: float) -> list[WeightApplied]:
        consumer = Consumer(self.kafka, [self.topics.weights], f"{self.group}-reader", client_suffix="test-reader")
        out: list[WeightApplied] = []
        deadline = time.monotonic() + timeout_s
        try:
            while not out and time.monotonic() < deadline:
                out += [p.record for p in consumer.poll(0.5) if isinstance(p.record, WeightApplied)]
        finally:
            consumer.close()
        return out


@pytest.fixture
def stack(
    kafka_bootstrap: str, redis_db_url: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> Iterator[Stack]:
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    topics = Topics(chunks=unique_topic(), events=unique_topic(), weights=unique_topic())
    with engine_and_proxy(
        kafka_bootstrap, topics, weights_dir, tmp_path / "logs", admin_token=ADMIN, step_delay_s=0.05
    ) as (engine, proxy):
        yield Stack(
            engine.url,
            proxy.url,
            weights_dir,
            KafkaSettings(bootstrap_servers=kafka_bootstrap),
            RedisSettings(url=redis_db_url, key_prefix=f"t{uuid.uuid4().hex[:8]}"),
            topics,
            unique_group,
            proxy.runner_token,
        )


def start_broadcaster(stack: Stack, **overrides: Any) -> tuple[threading.Thread, threading.Event, int]:
    port = free_port()
    settings = load(
        BroadcasterSettings,
        kafka=stack.kafka,
        redis=stack.redis,
        topics=stack.topics,
        proxy_urls=[stack.proxy],
        engine_urls=[stack.engine],
        admin_token=ADMIN,
        consumer_group=stack.group,
        metrics_port=port,
        log_json=False,
        **overrides,
    )
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run(settings, stop)
        except BaseException as exc:  # surfaced by the test through the thread's liveness
            errors.append(exc)
            raise

    thread = threading.Thread(target=target, name="broadcaster", daemon=True)
    thread.start()
    wait_until(lambda: _metrics(port) is not None or not thread.is_alive(), 60, "the broadcaster's /metrics")
    assert thread.is_alive(), errors
    return thread, stop, port


def _metrics(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.TransportError:
        return None


def _sample(port: int, name: str) -> float:
    text = _metrics(port) or ""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_published_version_is_applied_everywhere(stack: Stack) -> None:
    event = stack.checkpoint(1)
    assert stack.model_info()["digest"] != event.digest
    stack.publish(event)
    thread, stop, port = start_broadcaster(stack)
    try:
        wait_until(lambda: stack.model_info()["digest"] == event.digest, 60, "the engine to serve v1")
        applied = stack.applied(30)
        assert [(a.version, a.seq, a.digest, a.last_index) for a in applied] == [("v1", 1, event.digest, 3)]
        assert stack.model_info()["weight_version"] == "v1"
        assert not stack.proxy_state()["paused"]
        registry = RedisRegistry(connect(stack.redis), RedisKeys(stack.redis.key_prefix))
        assert registry.ordered() == [("v1", 1)]
        assert _sample(port, 'rein_broadcaster_versions_total{outcome="applied"}') == 1.0
        # the engine read the checkpoint before the pause; the update inside it only swapped it in
        assert _sample(port, "rein_broadcaster_staged_updates_total") == 1.0
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_unquiesced_pause_means_no_update(stack: Stack) -> None:
    before = stack.model_info()["digest"]
    # A pause's bound of 1 us ends before the engine can answer its abort (the answer needs another turn of
    # the proxy's event loop): never quiesced. 1 ms was not enough once the proxy's client got faster.
    thread, stop, port = start_broadcaster(stack, pause_timeout_s=1e-6, max_pause_attempts=1)
    result: dict[str, Any] = {}

    def chat() -> None:
        result["response"] = httpx.post(
            f"{stack.proxy}/v1/chat/completions",
            timeout=120,
            headers=stack.runner(f"s-{uuid.uuid4().hex}"),
            json={
                "model": "rein-tiny",
                "messages": [{"role": "user", "content": "guess"}],
                "max_tokens": 40,
                "ignore_eos": True,
            },
        )

    agent = threading.Thread(target=chat, name="agent", daemon=True)
    agent.start()
    try:
        wait_until(lambda: stack.proxy_state()["active"] >= 1, 30, "a generation in flight")
        stack.publish(stack.checkpoint(1))
        wait_until(
            lambda: _sample(port, 'rein_broadcaster_versions_total{outcome="unquiesced"}') >= 1,
            60,
            "the broadcaster to give the version up",
        )
        assert _sample(port, "rein_broadcaster_unquiesced_total") == 1.0
        assert stack.model_info()["digest"] == before  # never updated under an unquiesced proxy
        assert not stack.proxy_state()["paused"]  # resumed after the failed round
        agent.join(60)
        assert not agent.is_alive()
        assert result["response"].status_code == 200, result["response"].text
        # the round was given up before this point: the topic, read to its end, has the version, no WeightApplied
        on_topic = read_topic(stack.kafka, stack.topics.weights, 30)
        assert [type(r).__name__ for r in on_topic] == ["WeightPublished"]
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_member_joins_and_leaves_the_broadcasters_group(stack: Stack) -> None:
    """A foreign member takes half of ``weights`` while a version waits there: it is applied once the
    member leaves, the broadcaster stays alive, and no version is applied (announced) twice."""
    bootstrap = stack.kafka.bootstrap_servers
    thread, stop, _port = start_broadcaster(stack)
    tps = [TopicPartition(stack.topics.weights, p) for p in range(4)]

    def all_committed() -> bool:
        reader = KafkaConsumer(bootstrap_servers=bootstrap, group_id=stack.group, enable_auto_commit=False)
        try:
            end = reader.end_offsets(tps)
            return all((reader.committed(tp) or 0) == end[tp] for tp in tps)
        finally:
            reader.close()

    try:
        v1 = stack.checkpoint(1)
        stack.publish(v1)
        wait_until(lambda: stack.model_info()["digest"] == v1.digest, 60, "the engine to serve v1")
        wait_until(all_committed, 30, "the broadcaster to commit v1 and its WeightApplied")
        with ForeignMember(bootstrap, stack.group, [stack.topics.weights]) as member:
            theirs = sorted(p for _, p in member.partitions)
            v2 = stack.checkpoint(2)
            producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
            try:
                producer.send(stack.topics.weights, key=v2.key().encode(), value=encode(v2),
                              partition=theirs[0]).get(timeout=30)
            finally:
                producer.close(timeout=10)
            wait_until(lambda: member.records > 0, 30, "the foreign member to read v2")
            assert stack.model_info()["weight_version"] == "v1", "v2 is on the member's partition"
        wait_until(lambda: stack.model_info()["digest"] == v2.digest, 60, "v2 applied after the member left")
        wait_until(all_committed, 30, "the broadcaster to commit v2")
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    records = read_topic(stack.kafka, stack.topics.weights, 30)
    applied = Counter(r.version for r in records if isinstance(r, WeightApplied))
    assert applied == {"v1": 1, "v2": 1}


class StuckEngine:
    """An engine whose ``/update_weights_from_disk`` never answers (until the test ends): a
    broadcaster updating it is stuck between pause and resume, where the test kills it."""

    def __init__(self) -> None:
        self.update_started = threading.Event()
        self._release = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._json({"weight_version": "v0", "digest": "stuck", "model_path": "stuck"})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path == "/update_weights_from_disk":
                    stub.update_started.set()
                    stub._release.wait(120)
                self._json({"success": False, "message": "stuck engine"})

            def _json(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="stuck-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()


def _broadcaster_env(stack: Stack, engines: list[str], port: int, **extra: str) -> dict[str, str]:
    return {
        "REIN_KAFKA__BOOTSTRAP_SERVERS": stack.kafka.bootstrap_servers,
        "REIN_REDIS__URL": stack.redis.url,
        "REIN_REDIS__KEY_PREFIX": stack.redis.key_prefix,
        "REIN_TOPICS__WEIGHTS": stack.topics.weights,
        "REIN_CONSUMER_GROUP": stack.group,
        "REIN_PROXY_URLS": json.dumps([stack.proxy]),
        "REIN_ENGINE_URLS": json.dumps(engines),
        "REIN_ADMIN_TOKEN": ADMIN,
        "REIN_METRICS_PORT": str(port),
        "REIN_LOG_LEVEL": "info",
        **extra,
    }


def test_broadcaster_killed_between_pause_and_resume(stack: Stack, tmp_path: Path) -> None:
    """kill -9 of the broadcaster while an engine update hangs: the proxy holds its agents only until
    the pause's lease (3 s) runs out, then resumes by itself, counts it, and serves the held call;
    a new broadcaster applies the next version."""
    stuck = StuckEngine()
    lease_s = 3.0
    port = free_port()
    first = start_service(
        "services.weight_broadcaster",
        _broadcaster_env(stack, [stack.engine, stuck.url], port, REIN_PAUSE_LEASE_S=str(lease_s),
                         REIN_UPDATE_TIMEOUT_S="300", REIN_RECONCILE_INTERVAL_S="3600"),
        f"http://127.0.0.1:{port}/health", timeout_s=60, log_dir=tmp_path / "logs",
    )
    result: dict[str, Any] = {}
    agent: threading.Thread | None = None
    try:
        stack.publish(stack.checkpoint(1))
        assert stuck.update_started.wait(60), first.tail()
        state = stack.proxy_state()
        assert state["paused"] and state["pause_id"], state

        def chat() -> None:
            result["response"] = httpx.post(
                f"{stack.proxy}/v1/chat/completions", timeout=60, headers=stack.runner(f"s-{uuid.uuid4().hex}"),
                json={"model": "rein-tiny", "messages": [{"role": "user", "content": "guess"}], "max_tokens": 3},
            )

        agent = threading.Thread(target=chat, name="agent", daemon=True)
        agent.start()
        first.process.kill()
        first.process.wait(10)
        killed_at = time.monotonic()
        assert stack.proxy_state()["paused"], "the pause outlives its broadcaster until the lease runs out"
        wait_until(lambda: not stack.proxy_state()["paused"], lease_s + 5, "the proxy to resume by itself")
        resumed_after = time.monotonic() - killed_at
        agent.join(30)
        assert not agent.is_alive()
        assert result["response"].status_code == 200, result["response"].text
        metrics_text = httpx.get(f"{stack.proxy}/metrics", timeout=5).text
        assert "rein_proxy_pause_lease_expired_total 1.0" in metrics_text
        assert resumed_after <= lease_s + 2  # the renewals stopped with the process; the lease ended it
    finally:
        stuck.close()
        first.stop()
        if agent is not None:
            agent.join(30)
    # A new broadcaster (without the stuck engine) applies the next version.
    second = start_service(
        "services.weight_broadcaster", _broadcaster_env(stack, [stack.engine], port, REIN_PAUSE_LEASE_S="3"),
        f"http://127.0.0.1:{port}/health", timeout_s=60, log_dir=tmp_path / "logs",
    )
    try:
        v2 = stack.checkpoint(2)
        stack.publish(v2)
        wait_until(lambda: stack.model_info()["digest"] == v2.digest, 60, "the engine to serve v2")
        wait_until(lambda: not stack.proxy_state()["paused"], 30, "the proxy to be resumed")
        assert second.alive(), second.tail()
    finally:
        second.stop()
