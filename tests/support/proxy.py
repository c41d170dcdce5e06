"""Harness of the proxy integration tests (``tests/integration/proxy/``).

- The engine is a real subprocess from ``tests.support.stack.engine_process`` (one per module),
  slowed with ``step_delay_s`` so a generation is still running when a test pauses.
- ``proxy_factory``: builds a real proxy app per test and serves it with uvicorn in a
  background thread, on fresh Kafka topics (``REIN_TOPICS__CHUNKS`` / ``__EVENTS``
  equivalents) of the session's real broker, or on the topics and Kafka settings a test gives.
- helpers to read the records back from Kafka.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from kafka import KafkaConsumer, TopicPartition

from ops.local.ports import free_port
from services.proxy.app import create_app
from services.proxy.settings import ProxySettings
from shared.codec import decode
from shared.names import Topics
from shared.schemas import Record
from shared.settings import KafkaSettings
from tests.support.stack import Engine

ADMIN = "test-admin-token-0123"
RUNNER = "test-runner-token-4567"
"""The runner's credential of every ``proxy_factory`` proxy: what opens, drives by header and finishes sessions."""
KEY_SECRET = "test-session-key-secret-89ab"
RUN_ID = "test-run"


class ServerThread:
    """An ASGI app served by uvicorn in a daemon thread; ``stop()`` exits it and joins."""

    def __init__(self, app: Any, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
            )
        )
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def start(self, timeout_s: float = 60) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@dataclass
class Proxy:
    url: str
    settings: ProxySettings
    bootstrap: str
    admin: httpx.Client = field(init=False)
    clients: list[openai.OpenAI] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.admin = httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
        self.runner = httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {RUNNER}"})

    def client(self, session_id: str, group_id: str = "", **headers: str) -> openai.OpenAI:
        """The runner's client of one session, named by ``X-Session-Id``."""
        hdrs = {"X-Session-Id": session_id, **headers}
        if group_id:
            hdrs["X-Group-Id"] = group_id
        client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=RUNNER, default_headers=hdrs, max_retries=0, timeout=120
        )
        self.clients.append(client)
        return client

    def close(self) -> None:
        self.admin.close()
        self.runner.close()
        for client in self.clients:
            client.close()

    def state(self) -> dict[str, Any]:
        r = self.admin.get("/v1/rollout/state")
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def pause(self, timeout_s: float = 30) -> dict[str, Any]:
        r = self.admin.post("/v1/rollout/pause", json={"reason": "test", "timeout_s": timeout_s})
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def resume(self, version: str | None = None) -> dict[str, Any]:
        r = self.admin.post("/v1/rollout/resume", json={"version": version} if version else {})
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def finish(self, session_id: str, reward: float = 1.0) -> httpx.Response:
        return self.runner.post(f"/v1/sessions/{session_id}/finish", json={"reward": reward})

    def open(self, group_id: str, **body: Any) -> dict[str, Any]:
        """``POST /v1/sessions`` as the runner: the session's ids, key and base URLs."""
        r = self.runner.post("/v1/sessions", json={"group_id": group_id, **body})
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def records(self, kind: str, n: int, timeout_s: float = 30) -> list[Record]:
        topic = self.settings.topics.chunks if kind == "chunks" else self.settings.topics.events
        return read_records(self.bootstrap, topic, n, timeout_s)


ProxyFactory = Callable[..., Proxy]


@pytest.fixture
def proxy_factory(kafka_bootstrap: str, unique_topic: Callable[..., str]) -> Iterator[ProxyFactory]:
    servers: list[ServerThread] = []
    proxies: list[Proxy] = []

    def make(
        engine_urls: list[str], *, kafka: dict[str, Any] | None = None, topics: Topics | None = None, **overrides: Any
    ) -> Proxy:
        """A proxy on fresh topics (or ``topics``); ``kafka`` overrides fields of its KafkaSettings."""
        topics = topics or Topics(chunks=unique_topic(), events=unique_topic())
        settings = ProxySettings(
            admin_token=ADMIN,
            runner_token=RUNNER,
            session_key_secret=KEY_SECRET,
            run_id=RUN_ID,
            engine_urls=engine_urls,
            kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap, **(kafka or {})),
            topics=topics,
            log_json=False,
            **overrides,
        )
        server = ServerThread(create_app(settings), free_port())
        server.start()
        servers.append(server)
        proxy = Proxy(server.url, settings, kafka_bootstrap)
        proxies.append(proxy)
        return proxy

    try:
        yield make
    finally:
        for proxy in proxies:
            proxy.close()
        for server in servers:
            server.stop()


def read_records(bootstrap: str, topic: str, n: int, timeout_s: float = 30) -> list[Record]:
    """The first ``n`` records of ``topic`` (all partitions, in partition then offset order)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        out: list[Record] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            for _tp, msgs in sorted(consumer.poll(timeout_ms=200).items(), key=lambda kv: kv[0].partition):
                out.extend(decode(m.value) for m in msgs)
        assert len(out) >= n, f"expected {n} records on {topic}, got {len(out)}: {out}"
        return out
    finally:
        consumer.close()


def count_records(bootstrap: str, topic: str) -> int:
    """Records currently on ``topic`` (end offsets: what the broker has acked so far).

    A topic the broker does not know fails the test: a wrong name must not read as "nothing published"."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        known = consumer.partitions_for_topic(topic)
        assert known, f"no topic {topic!r} on {bootstrap}"
        parts = [TopicPartition(topic, p) for p in known]
        return sum(consumer.end_offsets(parts).values())
    finally:
        consumer.close()


def in_background(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` in a thread; the returned callable joins it and returns its result or raises its error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join(timeout_s: float = 120) -> Any:
        thread.join(timeout_s)
        assert not thread.is_alive(), "background call did not finish"
        if "error" in box:
            raise box["error"]
        return box["result"]

    return join


def generating(proxy: Proxy, engine: Engine, min_tokens: int = 2) -> Callable[[], bool]:
    """True once the proxy has an engine request in flight that has produced ``min_tokens``."""

    def check() -> bool:
        rids = set(proxy.state()["active_rids"])
        return any(r["rid"] in rids and r["completion_tokens"] >= min_tokens for r in engine.active())

    return check


def rein(resp: Any) -> dict[str, Any]:
    """The ``rein`` extension of an openai response object."""
    extra: dict[str, Any] = resp.model_extra["rein"]
    return extra
