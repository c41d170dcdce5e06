"""Engines that come and go: real engine processes register in Redis, a real proxy finds them, balances
new sessions over them, sticks each session to its engine, and when one hangs (SIGSTOP) or dies, rejects
on record the sessions holding its tokens without leaving any call hanging; records on real Kafka."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from ops.local.ports import free_port
from shared.membership import Members
from shared.names import RedisKeys, Topics
from shared.schemas import Chunk, SessionRejected
from shared.settings import RedisSettings
from shared.state import connect
from tests.support.procs import ServiceStartError
from tests.support.proxy import Proxy, ProxyFactory, count_records, in_background, proxy_factory, read_records, rein
from tests.support.stack import engine_process, proxy_process
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory"]

QUESTION = [{"role": "user", "content": "guess"}]


def test_registered_engines_share_sessions_and_a_hung_or_dead_one_loses_only_its_own(
    proxy_factory: ProxyFactory, redis_db_url: str, tmp_path: Path
) -> None:
    prefix = f"e{uuid.uuid4().hex[:8]}"
    redis = RedisSettings(url=redis_db_url, key_prefix=prefix)
    env = {"REIN_REDIS__URL": redis_db_url, "REIN_REDIS__KEY_PREFIX": prefix, "REIN_HEARTBEAT_S": "0.2",
           "REIN_REGISTRATION_TTL_S": "1.5"}
    members = Members(connect(redis), RedisKeys(prefix), "engine")
    with engine_process(tmp_path / "w", tmp_path / "la", step_delay_s=0.02, extra_env=env, advertise=True) as a, \
            engine_process(tmp_path / "w", tmp_path / "lb", step_delay_s=0.15, extra_env=env, advertise=True) as b:
        assert members.live() == sorted([a.url, b.url]), "each engine registered itself once it served"
        proxy = proxy_factory([], discover_engines=True, redis=redis, engine_health_interval_s=0.2,
                              engine_unhealthy_after=2, engine_connect_timeout_s=0.5)

        def standing() -> dict[str, dict[str, Any]]:
            return {e["url"]: e for e in proxy.state()["engines"]}

        assert {u: (e["registered"], e["healthy"]) for u, e in standing().items()} == {
            a.url: (True, True), b.url: (True, True)}, "found in Redis, no REIN_ENGINE_URLS"

        def call(session: str, max_tokens: int = 3) -> Any:
            return proxy.client(session, "g").chat.completions.create(
                model="m", messages=QUESTION, max_tokens=max_tokens, extra_body={"ignore_eos": True})

        on: dict[str, str] = {}
        for i in range(4):
            on[f"s{i}"] = rein(call(f"s{i}"))["engine"]
        assert sorted(on.values()) == sorted([a.url, a.url, b.url, b.url]), f"least loaded: two each, {on}"
        assert {u: e["sessions"] for u, e in standing().items()} == {a.url: 2, b.url: 2}
        for session, url in on.items():
            assert rein(call(session))["engine"] == url, "a session sticks to its engine"

        on_b = sorted(s for s, u in on.items() if u == b.url)
        on_a = sorted(s for s, u in on.items() if u == a.url)
        # A long call on b, in flight when b hangs: cut once b fails its health checks, never left waiting.
        long_call = in_background(lambda: call(on_b[0], max_tokens=50))  # 7.5 s on b
        wait_until(lambda: b.active() != [], 30, "the long call to reach engine b")
        assert b.proc.proc is not None
        b.proc.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as cut:
                long_call(30)
            took = time.monotonic() - started
            print(f"\nthe call on the hung engine ended after {took:.2f}s")
            assert cut.value.status_code == 503 and cut.value.response.json()["detail"]["error"] == "engine_lost"
            assert took < 10, f"the hung engine's call returned after {took:.1f}s"
            assert not standing()[b.url]["healthy"]
            with pytest.raises(openai.APIStatusError) as lost:
                call(on_b[1])
            assert lost.value.response.json()["detail"]["error"] == "engine_lost"
            assert rein(call("s-new"))["engine"] == a.url, "new sessions go to the healthy engine"
            for session in on_a:
                assert rein(call(session))["engine"] == a.url, "a's sessions go on"
        finally:
            b.proc.proc.send_signal(signal.SIGCONT)
        # Stopped, b could not renew its registration either: it registers again and is read again.
        wait_until(lambda: standing()[b.url]["healthy"] and standing()[b.url]["registered"], 10,
                   "b to answer its health checks again")
        assert rein(call("s-after"))["engine"] == b.url, "back: the least loaded engine again"

        rejected = _rejections(proxy, 2)
        assert rejected == {s: ("engine_lost", 2) for s in on_b}, "each with its two chunks, none of the cut call"
        chunks = [r for r in proxy.records("chunks", 12) if isinstance(r, Chunk)]
        assert {c.session_id: c.engine for c in chunks} == {**on, "s-new": a.url, "s-after": b.url}

        # a dies: its registration lapses and the proxy stops routing to it.
        assert a.proc.proc is not None
        a.proc.proc.kill()
        wait_until(lambda: members.live() == [b.url], 10, "a's registration to lapse")
        wait_until(lambda: not standing()[a.url]["registered"], 10, "the proxy to read that a left")
        with pytest.raises(openai.APIStatusError) as gone:
            call(on_a[0])
        assert gone.value.response.json()["detail"]["error"] == "engine_lost"
        assert rein(call("s-last"))["engine"] == b.url
    assert members.live() == [], "b stopped cleanly and left"
    members.client.close()


def _rejections(proxy: Proxy, n: int, timeout_s: float = 30) -> dict[str, tuple[str, int]]:
    """Session -> (error, num_chunks) of the rejections on the proxy's events topic, once there are ``n``."""
    topic = proxy.settings.topics.events
    found: dict[str, tuple[str, int]] = {}

    def enough() -> bool:
        found.clear()
        for r in read_records(proxy.bootstrap, topic, count_records(proxy.bootstrap, topic)):
            if isinstance(r, SessionRejected):
                found[r.session_id] = (r.error, r.num_chunks)
        return len(found) >= n

    wait_until(enough, timeout_s, "the rejections on record")
    return found


def test_a_proxy_that_cannot_read_the_registered_engines_does_not_start(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """With REIN_DISCOVER_ENGINES and no fixed engine, a proxy without Redis could route nowhere: it fails
    at start, saying why, instead of answering 503 to every call."""
    topics = Topics(chunks=unique_topic(), events=unique_topic())
    env = {"REIN_REDIS__URL": f"redis://127.0.0.1:{free_port()}/0", "REIN_REDIS__SOCKET_TIMEOUT_S": "0.5",
           "REIN_DISCOVER_ENGINES": "true"}
    with pytest.raises(ServiceStartError, match="did not answer"), proxy_process(
            [], kafka_bootstrap, topics, tmp_path, admin_token="registry-admin-token", extra_env=env):
        pass
