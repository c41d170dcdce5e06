"""Chunks off the request path: the answer does not wait for Kafka, the session's end does.

Real engine, real proxy, real Kafka. Acks are made slow deterministically with the proxy
producer's linger (``REIN_KAFKA__LINGER_MS``): a record is not even sent to the broker
before its batch has lingered that long, so whatever returns sooner did not wait for it.
A chunk that cannot be written is one for a topic that does not exist (auto-creation is
off on the test broker).
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ops.local.launcher import Child, Service
from shared.bus import read_topic
from shared.names import Topics
from shared.schemas import Chunk, GroupDispatched, Record, SessionFinished, SessionRejected
from shared.settings import KafkaSettings
from tests.support.proxy import ADMIN, Proxy, ProxyFactory, count_records, proxy_factory
from tests.support.stack import Engine, proxy_process, temp_engine
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory"]

LINGER_S = 3.0
ASK = [{"role": "user", "content": "guess"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Slowed a little, so several generations are still running when a test pauses."""
    with temp_engine(tmp_path_factory, step_delay_s=0.02) as engine:
        yield engine


def _lingering(proxy_factory: ProxyFactory, engine: Engine, **overrides: Any) -> Proxy:
    return proxy_factory([engine.url], kafka={"linger_ms": int(LINGER_S * 1000)}, **overrides)


def _scrape(proxy: Proxy, name: str) -> float:
    """Sum of a series of the proxy's /metrics whose line starts with ``name``."""
    text = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_the_answer_does_not_wait_for_the_ack_and_finish_does(engine: Engine, proxy_factory: ProxyFactory) -> None:
    proxy = _lingering(proxy_factory, engine)
    sid, gid = f"s-{uuid.uuid4().hex}", f"g-{uuid.uuid4().hex}"
    client = proxy.client(sid, gid)
    messages: list[dict[str, str]] = list(ASK)
    for turn in range(2):
        started = time.monotonic()
        resp = client.chat.completions.create(model="m", messages=messages, max_tokens=2)  # type: ignore[arg-type]
        took = time.monotonic() - started
        assert took < LINGER_S, f"the answer took {took:.2f}s: it waited for the chunk's ack"
        if turn == 0:
            assert _scrape(proxy, "rein_proxy_publish_inflight_records") == 1  # the gauge sees the lingering chunk
        messages += [{"role": "assistant", "content": resp.choices[0].message.content or ""},
                     {"role": "user", "content": "higher"}]

    r = proxy.finish(sid, reward=0.5)
    assert r.status_code == 200 and r.json()["num_chunks"] == 2
    # finish answered only after the acks: both chunks are on the topic now (end offsets, no waiting)
    assert count_records(proxy.bootstrap, proxy.settings.topics.chunks) == 2
    chunks = [c for c in proxy.records("chunks", 2) if isinstance(c, Chunk)]
    assert sorted(c.seq for c in chunks) == [0, 1] and {c.session_id for c in chunks} == {sid}
    (finished,) = proxy.records("events", 1)
    assert isinstance(finished, SessionFinished) and finished.num_chunks == 2
    assert _scrape(proxy, "rein_proxy_publish_inflight_records") == 0
    assert _scrape(proxy, "rein_proxy_chunks_published_total") == 2


def test_an_idle_session_is_rejected_only_after_its_chunks_are_acked(
    engine: Engine, proxy_factory: ProxyFactory
) -> None:
    proxy = _lingering(proxy_factory, engine, session_idle_timeout_s=0.5)
    sid = f"s-{uuid.uuid4().hex}"
    proxy.client(sid, "g-idle").chat.completions.create(model="m", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    (rejected,) = proxy.records("events", 1, timeout_s=60)
    (chunk,) = proxy.records("chunks", 1)
    assert isinstance(rejected, SessionRejected) and isinstance(chunk, Chunk)
    assert (rejected.session_id, rejected.error, rejected.num_chunks) == (sid, "session_idle", 1)
    # The sweep found the session idle ~0.5 s after the call, but made the rejection only once the
    # chunk was acked, which its linger makes at least LINGER_S after the chunk was made.
    assert rejected.ts - chunk.ts >= LINGER_S - 0.05, rejected.ts - chunk.ts


def test_a_chunk_kafka_cannot_take_rejects_the_session_at_finish_or_next_call(
    engine: Engine, proxy_factory: ProxyFactory, unique_topic: Callable[..., str]
) -> None:
    missing = f"t.never-created.{uuid.uuid4().hex[:8]}"
    proxy = proxy_factory([engine.url], topics=Topics(chunks=missing, events=unique_topic()),
                          kafka={"max_block_ms": 1000, "request_timeout_ms": 2000})
    at_finish, at_call = f"s-{uuid.uuid4().hex}", f"s-{uuid.uuid4().hex}"

    resp = proxy.client(at_finish, "g-f").chat.completions.create(model="m", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    assert resp.choices[0].message.role == "assistant"  # answered: the write is not on the call's path
    r = proxy.finish(at_finish)
    assert r.status_code == 503 and r.json()["detail"]["error"] == "kafka_unavailable"
    assert proxy.finish(at_finish).status_code == 409  # rejected, not left open

    client = proxy.client(at_call, "g-c")
    client.chat.completions.create(model="m", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    wait_until(lambda: _scrape(proxy, 'rein_proxy_publish_failures_total{record="chunk"}') >= 2,
               timeout_s=30, what="the second session's chunk refused")
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    assert info.value.status_code == 503
    assert info.value.response.json()["detail"]["error"] == "kafka_unavailable"

    events = proxy.records("events", 2)
    assert sorted((e.session_id, e.error, e.num_chunks) for e in events if isinstance(e, SessionRejected)) == sorted(
        [(at_finish, "kafka_unavailable", 0), (at_call, "kafka_unavailable", 0)]
    )
    assert count_records(proxy.bootstrap, proxy.settings.topics.events) == 2


def test_pause_costs_the_abort_not_the_acks(engine: Engine, proxy_factory: ProxyFactory) -> None:
    proxy = _lingering(proxy_factory, engine)
    sessions = [f"s-{uuid.uuid4().hex}" for _ in range(4)]
    answers: dict[str, Any] = {}

    def call(sid: str) -> None:
        client = proxy.client(sid, f"g-{sid}")
        try:
            answers[sid] = client.chat.completions.create(
                model="m", messages=ASK, max_tokens=60, extra_body={"ignore_eos": True}  # type: ignore[arg-type]
            )
        except openai.APIError as exc:
            answers[sid] = exc

    threads = [threading.Thread(target=call, args=(sid,), daemon=True) for sid in sessions]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: proxy.state()["active"] == len(sessions), timeout_s=30, what="every generation running")
        started = time.monotonic()
        paused = proxy.pause()
        took = time.monotonic() - started
        assert paused["quiesced"] and paused["preempted"], paused
        # The preempted chunks' acks need LINGER_S; the pause returned without them.
        assert took < LINGER_S and paused["waited_s"] < LINGER_S, (took, paused)
    finally:
        resumed = proxy.resume()  # also when an assertion failed: the held calls must end
        for t in threads:
            t.join(60)
    assert resumed["status"] == "resumed"
    assert sorted(answers) == sorted(sessions) and not any(isinstance(a, Exception) for a in answers.values()), answers

    counts = {}
    for sid in sessions:
        r = proxy.finish(sid)
        assert r.status_code == 200, r.text
        counts[sid] = r.json()["num_chunks"]
    assert sum(counts.values()) >= len(sessions) + 1  # at least one call was continued after the pause
    chunks = [c for c in proxy.records("chunks", sum(counts.values())) if isinstance(c, Chunk)]
    for sid in sessions:
        assert sorted(c.seq for c in chunks if c.session_id == sid) == list(range(counts[sid]))
    assert _scrape(proxy, "rein_proxy_pause_closed_seconds_count") == 1


def test_a_proxy_killed_before_its_acks_leaves_nothing_on_kafka_and_the_runner_ends_its_sessions(
    engine: Engine, kafka_bootstrap: str, redis_url: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """The product's path for a dead proxy: the rollout runner's agents lose it, and the runner
    publishes ``session_lost`` for every session whose end the proxy never confirmed."""
    topics = Topics(chunks=unique_topic(), events=unique_topic())
    with proxy_process([engine.url], kafka_bootstrap, topics, tmp_path, admin_token=ADMIN,
                       extra_env={"REIN_KAFKA__LINGER_MS": "120000"}) as proxy:
        runner, log_path = _start_runner(proxy.url, proxy.runner_token, kafka_bootstrap, topics, redis_url,
                                         unique_topic, tmp_path)
        try:
            metrics = f"{proxy.url}/metrics"
            wait_until(lambda: 'route="/v1/chat/completions",status="200"' in httpx.get(metrics, timeout=10).text,
                       timeout_s=150, what="an answered chat call", proc=proxy.proc)
            proxy.proc.process.kill()  # kill -9 between the answer and its chunk's ack (120 s away)
            proxy.proc.process.wait(30)
            assert count_records(kafka_bootstrap, topics.chunks) == 0  # the answered chunk never reached Kafka
            settings = KafkaSettings(bootstrap_servers=kafka_bootstrap)

            def ended() -> list[Record]:
                events = read_topic(settings, topics.events, timeout_s=30)
                return events if sum(isinstance(e, SessionRejected) for e in events) >= 2 else []

            events = wait_until(ended, timeout_s=120, what="the runner's ends of the lost sessions", interval_s=0.5)
        finally:
            runner.terminate()  # the runner keeps waiting for its proxy to come back; stop it
            try:
                runner.wait(30)
            except subprocess.TimeoutExpired:
                runner.kill()
                runner.wait(10)
    (group,) = [e for e in events if isinstance(e, GroupDispatched)]
    lost = {e.session_id: e for e in events if isinstance(e, SessionRejected)}
    assert set(lost) == set(group.session_ids), (group.session_ids, lost, log_path.read_text()[-4000:])
    assert all(e.error == "session_lost" and e.num_chunks is None for e in lost.values())
    assert count_records(kafka_bootstrap, topics.chunks) == 0


def _start_runner(
    proxy_url: str, runner_token: str, bootstrap: str, topics: Topics, redis_url: str,
    unique_topic: Callable[..., str], logs: Path,
) -> tuple[Child, Path]:
    """``python -m services.rollout`` for one group of two, on the test's topics (stopped by the test)."""
    tag = uuid.uuid4().hex[:8]
    env = {
        "REIN_PROXY_URL": proxy_url, "REIN_RUNNER_TOKEN": runner_token,
        "REIN_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "REIN_TOPICS__EVENTS": topics.events, "REIN_TOPICS__CHUNKS": topics.chunks,
        "REIN_TOPICS__RETRIES": unique_topic(), "REIN_TOPICS__WEIGHTS": unique_topic(),
        "REIN_RETRY_CONSUMER_GROUP": f"g-{tag}", "REIN_REDIS__URL": redis_url, "REIN_REDIS__KEY_PREFIX": f"t-{tag}",
        "REIN_METRICS_PORT": "0", "REIN_GROUP_SIZE": "2", "REIN_MAX_GROUPS": "1", "REIN_REQUEST_TIMEOUT_S": "30",
        "REIN_STARTUP_TIMEOUT_S": "120", "REIN_DRAIN_TIMEOUT_S": "5",
    }
    log_path = logs / f"rollout-{tag}.log"
    runner = Service("rollout", "services.rollout", env, None, log_path, new_session=False)
    runner.start()
    return runner.process, log_path
