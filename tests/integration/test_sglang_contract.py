"""rein's proxy and weight broadcaster against an engine that speaks only SGLang's native API.

The engine is :class:`tests.support.sglang_engine.ScriptedSGLang` (SGLang's routes and field
names, no ``/model_info``, no digest, no per-token versions, ``context_length`` null as in a
default SGLang launch); the proxy is the real app (uvicorn thread), the broadcaster the real
loop (thread), Kafka and Redis the session's real ones.

- A chat call through the official ``openai`` client succeeds; the proxy's window is
  ``max_req_input_len`` from ``/get_server_info``, and it sends SGLang fields only.
- Pause aborts the generation in flight (``/abort_request``), resume without a version reads
  ``/get_model_info``, and the generation continues under the engine's new label.
- The broadcaster loads a version with ``/update_weights_from_disk`` and verifies it by the
  ``weight_version`` the engine then reports; an engine that keeps its old label fails the update.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ops.local.ports import free_port
from services.weight_broadcaster.service import run
from services.weight_broadcaster.settings import BroadcasterSettings
from shared.bus import Producer, read_topic
from shared.names import RedisKeys, Topics
from shared.schemas import Chunk, WeightApplied, WeightPublished
from shared.settings import KafkaSettings, RedisSettings, load
from shared.state import RedisRegistry, connect
from shared.tokenizer import TOKENIZER
from tests.support.proxy import (
    ADMIN,
    RUNNER,
    Proxy,
    ProxyFactory,
    in_background,
    proxy_factory,
    rein,
)
from tests.support.sglang_engine import ScriptedServers, ScriptedSGLang, sglang
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory", "sglang"]

USER = [{"role": "user", "content": "guess"}]
PROMPT = TOKENIZER.apply_chat_template(USER, add_generation_prompt=True)


def ask(client: openai.OpenAI, max_tokens: int) -> Any:
    return client.chat.completions.create(model="m", messages=USER, max_tokens=max_tokens,  # type: ignore[arg-type]
                                          temperature=1.0)


def decoding(engine: ScriptedSGLang, min_tokens: int = 2) -> Callable[[], bool]:
    return lambda: any(len(r.output_ids) >= min_tokens for r in list(engine.running.values()))


def chunks(proxy: Proxy, n: int, session_id: str) -> list[Chunk]:
    """The chunks of ``session_id`` in order, once the topic holds ``n`` records."""
    found = [r for r in proxy.records("chunks", n) if isinstance(r, Chunk) and r.session_id == session_id]
    return sorted(found, key=lambda c: c.seq)


def test_chat_pause_abort_resume_against_sglang(
    sglang: ScriptedServers, proxy_factory: ProxyFactory
) -> None:
    engine, url = sglang(max_req_input_len=40)
    proxy = proxy_factory([url])
    sid, sid2 = f"s-{uuid.uuid4().hex}", f"s-{uuid.uuid4().hex}"
    client = proxy.client(sid, f"g-{uuid.uuid4().hex}")

    resp = ask(client, max_tokens=100)  # more than the window leaves: the window bounds it
    info = rein(resp)
    room = engine.max_req_input_len - len(PROMPT)
    [body] = engine.generate_bodies
    assert body["input_ids"] == PROMPT and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == room
    assert resp.choices[0].finish_reason == "length" and len(info["output_ids"]) == room
    assert resp.choices[0].message.content == TOKENIZER.decode(info["output_ids"])
    [state] = proxy.state()["engines"]
    assert (state["context_window"], state["version"]) == (engine.max_req_input_len, "default")
    assert engine.info_reads == ["/get_model_info", "/get_server_info"]  # at the proxy's start

    client2 = proxy.client(sid2, f"g-{uuid.uuid4().hex}")
    join = in_background(lambda: ask(client2, max_tokens=12))
    wait_until(decoding(engine), what="a generation in flight")
    [rid] = list(engine.running)
    paused = proxy.pause()
    assert paused["quiesced"] is True and len(paused["preempted"]) == 1
    assert engine.aborts == [{"rid": rid, "abort_all": False}] and not engine.running
    engine.weight_version = "v7"  # as if loaded while paused; the proxy learns it from /get_model_info
    proxy.resume()
    assert engine.info_reads[-1] == "/get_model_info"
    resp2 = join()
    assert resp2.choices[0].finish_reason == "length" and len(rein(resp2)["output_ids"]) == 12

    [first] = chunks(proxy, 3, sid)
    preempted, continued = chunks(proxy, 3, sid2)
    assert (preempted.finish_reason, preempted.version) == ("abort", "default")
    assert (continued.finish_reason, continued.version) == ("length", "v7")
    assert preempted.output_ids + continued.output_ids == rein(resp2)["output_ids"]
    assert engine.generate_bodies[-1]["input_ids"] == PROMPT + preempted.output_ids
    assert first.version == "default"
    # the model's stop ids reach the engine on every /generate (SGLang knows only the config's EOS)
    stops = [TOKENIZER.end_id]
    assert all(b["sampling_params"]["stop_token_ids"] == stops for b in engine.generate_bodies)
    # a request's stop strings go to the engine as SGLang's ``stop``
    client.chat.completions.create(model="m", messages=USER, max_tokens=2, stop=["Observation:", "\n\n"])  # type: ignore[arg-type]
    assert engine.generate_bodies[-1]["sampling_params"]["stop"] == ["Observation:", "\n\n"]
    assert "stop" not in engine.generate_bodies[0]["sampling_params"]


def test_a_long_streamed_call_is_kept_alive_then_sent_whole(
    sglang: ScriptedServers, proxy_factory: ProxyFactory
) -> None:
    """Past one heartbeat a streamed call answers 200 and sends SSE comments until its frames are ready;
    the openai client reads through them."""
    engine, url = sglang(token_delay_s=0.05)
    proxy = proxy_factory([url], stream_heartbeat_s=0.1)
    body = {"model": "m", "messages": USER, "max_tokens": 12, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Session-Id": f"s-{uuid.uuid4().hex}", "Authorization": f"Bearer {RUNNER}"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data >= 2 and all(line == ": keep-alive" for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
    client = proxy.client(f"s-{uuid.uuid4().hex}")
    stream = client.chat.completions.create(model="m", messages=USER, max_tokens=12, stream=True)  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text and len(engine.generate_bodies) == 2


def start_broadcaster(proxy: Proxy, engine_url: str, weights_topic: str, redis: RedisSettings, group: str,
                      **overrides: Any) -> tuple[threading.Thread, threading.Event, int]:
    port = free_port()
    settings = load(
        BroadcasterSettings, kafka=proxy.settings.kafka, redis=redis,
        topics=Topics(chunks=proxy.settings.topics.chunks, events=proxy.settings.topics.events, weights=weights_topic),
        proxy_urls=[proxy.url], engine_urls=[engine_url], admin_token=ADMIN, consumer_group=group,
        metrics_port=port, log_json=False, **overrides,
    )
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(settings, stop), name="broadcaster", daemon=True)
    thread.start()
    wait_until(lambda: _outcomes(port) is not None or not thread.is_alive(), 60, "the broadcaster's /metrics")
    assert thread.is_alive()
    return thread, stop, port


def _outcomes(port: int) -> dict[str, float] | None:
    """``rein_broadcaster_versions_total`` by outcome (None while the server is not up)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.TransportError:
        return None
    prefix = 'rein_broadcaster_versions_total{outcome="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def publish(kafka: KafkaSettings, topic: str, event: WeightPublished) -> None:
    producer = Producer(kafka, client_suffix="test")
    try:
        producer.send(topic, event)
    finally:
        producer.close()


@pytest.fixture
def redis_settings(redis_db_url: str) -> RedisSettings:
    return RedisSettings(url=redis_db_url, key_prefix=f"t{uuid.uuid4().hex[:8]}")


def test_broadcaster_applies_and_verifies_a_version_by_its_label(
    sglang: ScriptedServers, proxy_factory: ProxyFactory, unique_topic: Callable[..., str],
    unique_group: str, redis_settings: RedisSettings, tmp_path: Path,
) -> None:
    engine, url = sglang(stall_after=2)
    proxy = proxy_factory([url])
    weights_topic = unique_topic(1)
    checkpoint_dir = tmp_path / "step-1"  # SGLang loads a Hugging Face directory
    checkpoint_dir.mkdir()
    sid = f"s-{uuid.uuid4().hex}"
    client = proxy.client(sid, f"g-{uuid.uuid4().hex}")
    join = in_background(lambda: ask(client, max_tokens=12))
    wait_until(decoding(engine), what="a generation in flight")
    thread, stop, port = start_broadcaster(proxy, url, weights_topic, redis_settings, unique_group)
    try:
        event = WeightPublished(version="v1", seq=1, path=str(checkpoint_dir), digest="sha-sglang-never-reports",
                                step=1)
        publish(proxy.settings.kafka, weights_topic, event)
        wait_until(lambda: (_outcomes(port) or {}).get("applied") == 1.0, 60, "the version to be applied")
        assert engine.updates == [{"model_path": str(checkpoint_dir), "weight_version": "v1",
                                   "abort_all_requests": False}]
        assert engine.weight_version == "v1" and engine.model_path == str(checkpoint_dir)
        assert len(engine.aborts) == 1  # the proxy's pause aborted the generation in flight
        engine.stall_after = None
        resp = join()
        assert len(rein(resp)["output_ids"]) == 12
        preempted, continued = chunks(proxy, 2, sid)
        assert (preempted.finish_reason, preempted.version, continued.version) == ("abort", "default", "v1")
        assert len(preempted.output_ids) == 2
        assert engine.generate_bodies[-1]["input_ids"] == PROMPT + preempted.output_ids
        assert not proxy.state()["paused"] and proxy.state()["engines"][0]["version"] == "v1"
        records = read_topic(proxy.settings.kafka, weights_topic, 30)
        assert [(r.version, r.seq) for r in records if isinstance(r, WeightApplied)] == [("v1", 1)]
        assert RedisRegistry(connect(redis_settings), RedisKeys(redis_settings.key_prefix)).ordered() == [("v1", 1)]
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_an_engine_that_does_not_take_the_label_fails_the_update(
    sglang: ScriptedServers, proxy_factory: ProxyFactory, unique_topic: Callable[..., str],
    unique_group: str, redis_settings: RedisSettings, tmp_path: Path,
) -> None:
    engine, url = sglang(keep_label=True)
    proxy = proxy_factory([url])
    weights_topic = unique_topic(1)
    thread, stop, port = start_broadcaster(proxy, url, weights_topic, redis_settings, unique_group,
                                           max_update_attempts=1, max_pause_attempts=1)
    try:
        publish(proxy.settings.kafka, weights_topic,
                WeightPublished(version="v1", seq=1, path=str(tmp_path), digest="d", step=1))
        wait_until(lambda: (_outcomes(port) or {}).get("update_failed") == 1.0, 60, "the update to be failed")
        assert len(engine.updates) == 1 and engine.weight_version == "default"
        assert not proxy.state()["paused"]  # resumed, without a version
        assert proxy.state()["engines"][0]["version"] == "default"
        records = read_topic(proxy.settings.kafka, weights_topic, 30)
        assert not [r for r in records if isinstance(r, WeightApplied)]
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
