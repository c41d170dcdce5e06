"""A session continues on another proxy replica when its proxy dies between calls; it is refused when the
proxy died during a call; a replica whose session was taken over drops its copy.

Two real proxy processes (the same credentials and Redis, each advertised as a replica) in front of one
real engine, real Kafka: the agent's calls go to one proxy or the other as a balancer would send them after
a failure. The chunk log on Kafka is read back: one session's records, numbered on without a gap, the
continued call extending the segment token-exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client import CollectorRegistry

from ops.local.ports import free_port
from services.proxy.handoff import MARK_TIMEOUT_S, Handoff
from services.proxy.metrics import ProxyMetrics
from services.proxy.session_machine import Session
from shared.errors import StateStoreUnavailable
from shared.names import RedisKeys, Topics
from shared.schemas import Chunk, SessionFinished
from tests.support.proxy import read_records
from tests.support.stack import Engine, ProxyProcess, proxy_process, temp_engine
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]

ADMIN = "handoff-admin-token"


@dataclass
class Pair:
    a: ProxyProcess
    b: ProxyProcess
    topics: Topics
    bootstrap: str
    redis: redis.Redis
    keys: RedisKeys

    def client(self, proxy: ProxyProcess, sid: str, gid: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.runner_token, max_retries=0, timeout=60,
                             default_headers={"X-Session-Id": sid, "X-Group-Id": gid})

    def finish(self, proxy: ProxyProcess, sid: str) -> httpx.Response:
        return httpx.post(f"{proxy.url}/v1/sessions/{sid}/finish", json={"reward": 1.0, "status": "completed"},
                          headers={"Authorization": f"Bearer {proxy.runner_token}"}, timeout=30)

    def hash(self, sid: str) -> dict[str, str]:
        return self.redis.hgetall(self.keys.session(sid))  # type: ignore[return-value]

    def metric(self, proxy: ProxyProcess, name: str) -> float:
        text = httpx.get(f"{proxy.url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with temp_engine(tmp_path_factory, step_delay_s=0.05) as engine:
        yield engine


@pytest.fixture
def pair(engine: Engine, kafka_bootstrap: str, unique_topic: Callable[..., str], redis_db_url: str,
         tmp_path: Path) -> Iterator[Pair]:
    topics = Topics(chunks=unique_topic(), events=unique_topic())
    prefix = f"h{uuid.uuid4().hex[:8]}"
    env = {"REIN_REDIS__URL": redis_db_url, "REIN_REDIS__KEY_PREFIX": prefix}
    client = redis.Redis.from_url(redis_db_url, decode_responses=True)
    with ExitStack() as stack:
        a = stack.enter_context(proxy_process([engine.url], kafka_bootstrap, topics, tmp_path / "a", admin_token=ADMIN,
                                              extra_env={**env, "REIN_ADVERTISE_URL": "http://proxy-a:8000"}))
        same = a.credentials.proxy_env()  # one deployment: every replica holds the same secrets
        b = stack.enter_context(proxy_process([engine.url], kafka_bootstrap, topics, tmp_path / "b", admin_token=ADMIN,
                                              extra_env={**env, **same, "REIN_ADVERTISE_URL": "http://proxy-b:8000"}))
        b.credentials = a.credentials
        yield Pair(a, b, topics, kafka_bootstrap, client, RedisKeys(prefix))
    client.close()


def _kill(proxy: ProxyProcess) -> None:
    proxy.proc.process.kill()
    proxy.proc.process.wait(timeout=10)


def _call(pair: Pair, proxy: ProxyProcess, sid: str, gid: str, messages: list[dict[str, Any]],
          max_tokens: int = 4) -> dict[str, Any]:
    """One chat call; a long one (``max_tokens`` over 4) runs to its budget."""
    with pair.client(proxy, sid, gid) as client:
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True} if max_tokens > 4 else None)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    rein: dict[str, Any] = reply.model_extra["rein"]  # type: ignore[index]
    return rein


def _saved(pair: Pair, sid: str, calls: int) -> Callable[[], bool]:
    return lambda: pair.hash(sid).get("saved") == str(calls)


def _first_call_on_a(pair: Pair) -> tuple[str, str, list[dict[str, Any]]]:
    """A new session's first call on proxy a, its snapshot written; the messages of its second call."""
    sid, gid = f"s-{uuid.uuid4().hex}", f"g-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "guess"}]
    _call(pair, pair.a, sid, gid, messages)
    wait_until(_saved(pair, sid, 1), 10, "the snapshot after the first call")
    messages.append({"role": "user", "content": "higher"})
    return sid, gid, messages


def test_a_session_continues_token_exact_on_another_replica_after_its_proxy_died(pair: Pair) -> None:
    sid, gid = f"s-{uuid.uuid4().hex}", f"g-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "guess"}]
    first = _call(pair, pair.a, sid, gid, messages)
    messages.append({"role": "user", "content": "higher"})
    second = _call(pair, pair.a, sid, gid, messages)
    assert (first["segment_index"], second["segment_index"], second["new_segment"]) == (0, 0, False)
    wait_until(_saved(pair, sid, 2), 10, "the snapshot after the second call")
    _kill(pair.a)

    messages.append({"role": "user", "content": "lower"})
    third = _call(pair, pair.b, sid, gid, messages)  # the balancer now sends the session here
    assert (third["segment_index"], third["new_segment"]) == (0, False)
    finished = pair.finish(pair.b, sid)
    assert finished.status_code == 200, finished.text
    assert pair.metric(pair.b, 'rein_proxy_session_takeovers_total{outcome="continued"}') == 1

    chunks = [r for r in read_records(pair.bootstrap, pair.topics.chunks, 3) if isinstance(r, Chunk)]
    assert [c.seq for c in chunks] == [0, 1, 2] and {c.segment_index for c in chunks} == {0}
    # token-exact: the third call extended segment 0 (its prompt: the ids of the first two, then the delta)
    assert chunks[2].context_ids and third["output_ids"] == chunks[2].output_ids
    end = [r for r in read_records(pair.bootstrap, pair.topics.events, 1) if isinstance(r, SessionFinished)]
    assert [(e.session_id, e.num_chunks) for e in end] == [(sid, 3)]
    assert pair.hash(sid)["end"] == "finished"


def test_a_session_whose_proxy_died_during_a_call_is_refused_elsewhere(pair: Pair) -> None:
    sid, gid, messages = _first_call_on_a(pair)
    slow = threading.Thread(target=lambda: _swallow(lambda: _call(pair, pair.a, sid, gid, list(messages), 200)),
                            daemon=True)
    slow.start()
    wait_until(lambda: pair.hash(sid).get("calls") == "2", 10, "the second call begun on proxy a")
    _kill(pair.a)  # 200 tokens at 0.05 s each: the call is still generating
    slow.join(timeout=30)

    with pytest.raises(openai.ConflictError) as refused:
        _call(pair, pair.b, sid, gid, messages)
    assert refused.value.response.json()["detail"]["error"] == "session_interrupted"
    assert pair.finish(pair.b, sid).json()["detail"]["error"] == "session_interrupted"
    assert pair.metric(pair.b, 'rein_proxy_session_takeovers_total{outcome="interrupted"}') == 2


def test_a_replica_whose_session_was_taken_over_drops_its_copy(pair: Pair) -> None:
    sid, gid, messages = _first_call_on_a(pair)
    _call(pair, pair.b, sid, gid, messages)  # a was out of the balancer's rotation, not dead
    stale = pair.finish(pair.a, sid)  # a's copy must not end the session with its count
    assert stale.status_code == 409 and stale.json()["detail"]["error"] == "session_moved", stale.text
    assert pair.metric(pair.a, "rein_proxy_sessions_moved_total") == 1
    messages.append({"role": "user", "content": "lower"})
    with pytest.raises(openai.ConflictError) as refused:
        _call(pair, pair.a, sid, gid, messages)
    assert refused.value.response.json()["detail"]["outcome"] == "moved to another proxy replica"
    _call(pair, pair.b, sid, gid, messages)  # b holds it on
    assert pair.finish(pair.b, sid).status_code == 200
    chunks = [r for r in read_records(pair.bootstrap, pair.topics.chunks, 3) if isinstance(r, Chunk)]
    assert [c.seq for c in chunks] == [0, 1, 2]
    ends = [r for r in read_records(pair.bootstrap, pair.topics.events, 1) if isinstance(r, SessionFinished)]
    assert [e.num_chunks for e in ends] == [3]


def _swallow(call: Callable[[], object]) -> None:
    with contextlib.suppress(openai.APIError, httpx.HTTPError):  # the proxy dies under this call
        call()


def test_with_redis_down_a_call_goes_on_and_a_takeover_is_refused_503() -> None:
    """A dead Redis (nothing listens): marking a call and saving a snapshot are logged and counted, and the call
    goes on; a takeover cannot tell whether the session exists elsewhere, so it is 503 (the agent retries)."""
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_timeout=1, socket_connect_timeout=1)
    metrics = ProxyMetrics(CollectorRegistry())
    handoff = Handoff(dead, RedisKeys("dead"), "http://proxy-a:8000#p-1", 60.0, 1.0, metrics)

    async def scenario() -> None:
        started = time.monotonic()
        await handoff.begin("s-1")  # does not raise: the call goes on, at most MARK_TIMEOUT_S later
        assert time.monotonic() - started < MARK_TIMEOUT_S + 0.5
        handoff.save(Session(session_id="s-1", group_id="g"), [])
        await handoff.close(timeout_s=10)  # the save is written (or not) in the background
        with pytest.raises(StateStoreUnavailable):
            await handoff.take("s-2")
        handoff.ended("s-1", "finished")
        await handoff.close(timeout_s=10)

    asyncio.run(scenario())
    errors = {op: metrics.registry.get_sample_value("rein_proxy_session_store_errors_total", {"op": op})
              for op in ("begin", "save", "take", "end")}
    assert errors == {"begin": 1, "save": 1, "take": 1, "end": 1}
    dead.close()
