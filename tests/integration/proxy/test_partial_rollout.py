"""Partial rollout end to end: pause -> weight update -> resume, the span cap, soft reject.

Real engine subprocess (slowed so generations are in flight when paused), real proxy,
real Kafka. Every test first loads fresh weights under unique labels, so tests do not
depend on each other's engine state.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ops.local.ports import free_port
from shared.schemas import Chunk, SessionRejected
from shared.span_cap import check_span
from tests.support.engine_fronts import CountingFront, NaturalStopShim
from tests.support.proxy import (
    Proxy,
    ProxyFactory,
    ServerThread,
    generating,
    in_background,
    proxy_factory,
    rein,
)
from tests.support.stack import Engine, temp_engine
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory"]

USER = [{"role": "user", "content": "guess"}]
SLOW = {"ignore_eos": True}
STEP_DELAY_S = 0.05
IN_FLIGHT_TOKENS = 60
"""Reply length of a generation a test acts on mid-flight (the most the tiny policy's context leaves
after the prompts here): 3 s at ``STEP_DELAY_S`` per decode step. A 30-token reply at 30 ms (0.9 s)
was once over before ``wait_until`` saw it in flight (two HTTP polls per check on a machine at load
~20), and the test timed out waiting for it."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with temp_engine(tmp_path_factory, step_delay_s=STEP_DELAY_S) as engine:
        yield engine


def labels(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:6]
    return [f"{chr(ord('a') + i)}-{tag}" for i in range(n)]


def ask(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int = 2, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="m",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        extra_body=SLOW,
        **kw,
    )


def follow(messages: list[dict[str, str]], resp: Any, user: str = "higher") -> list[dict[str, str]]:
    return [
        *messages,
        {"role": "assistant", "content": resp.choices[0].message.content or ""},
        {"role": "user", "content": user},
    ]


def session_on(
    engine: Engine, proxy_factory: ProxyFactory, version: str, headers: dict[str, str] | None = None, **settings: Any
) -> tuple[Proxy, str, openai.OpenAI]:
    """The engine serving ``version``, a proxy in front of it (``settings``: the factory's keywords) and the
    runner's client of one fresh session in group ``g`` (with ``headers``): (proxy, session id, client)."""
    engine.load(version)
    proxy = proxy_factory([engine.url], **settings)
    sid = f"s-{uuid.uuid4().hex}"
    return proxy, sid, proxy.client(sid, "g", **(headers or {}))


def chunks_of(proxy: Proxy, n: int) -> list[Chunk]:
    return [r for r in proxy.records("chunks", n) if isinstance(r, Chunk)]


def rejected_of(proxy: Proxy) -> SessionRejected:
    (record,) = proxy.records("events", 1)
    assert isinstance(record, SessionRejected)
    return record


def preempt(proxy: Proxy, engine: Engine, new_label: str) -> dict[str, Any]:
    """With one generation in flight: pause (must quiesce), load ``new_label`` on the engine."""
    wait_until(generating(proxy, engine, 2), what="a generation in flight")
    paused = proxy.pause()
    assert paused["status"] == "paused" and paused["quiesced"] is True and paused["active"] == 0
    assert len(paused["preempted"]) == 1
    wait_until(lambda: proxy.state()["held"] == 1, what="the generation to be held")
    engine.load(new_label)
    return paused


def test_pause_update_resume_stitches_one_response(engine: Engine, proxy_factory: ProxyFactory) -> None:
    a, b = labels(2)
    proxy, _, client = session_on(engine, proxy_factory, a)
    join = in_background(lambda: ask(client, USER, max_tokens=IN_FLIGHT_TOKENS))
    paused = preempt(proxy, engine, b)
    assert proxy.state()["paused"] is True
    assert proxy.resume(b)["status"] == "resumed"
    resp = join()
    info = rein(resp)
    chunks = chunks_of(proxy, 2)
    assert [c.version for c in chunks] == [a, b]
    assert [c.finish_reason for c in chunks] == ["abort", "length"]
    assert [c.chunk_index for c in chunks] == [0, 1] and [c.seq for c in chunks] == [0, 1]
    assert chunks[0].rid == paused["preempted"][0] and chunks[1].context_ids == []
    assert chunks[0].output_ids and chunks[1].output_ids
    assert info["output_ids"] == chunks[0].output_ids + chunks[1].output_ids
    assert len(info["output_ids"]) == IN_FLIGHT_TOKENS and resp.choices[0].finish_reason == "length"
    assert info["versions"] == [a] * len(chunks[0].output_ids) + [b] * len(chunks[1].output_ids)
    assert proxy.state()["held"] == 0 and proxy.state()["paused"] is False


def test_max_preempts_1_rejects_third_version_before_generating(engine: Engine, proxy_factory: ProxyFactory) -> None:
    a, b, c = labels(3)
    proxy, sid, client = session_on(engine, proxy_factory, a, max_preempts=1)
    m1 = USER
    r1 = ask(client, m1)
    engine.load(b)  # between turns: counts like a preempt
    m2 = follow(m1, r1)
    r2 = ask(client, m2)
    assert {v for v in rein(r2)["versions"]} == {b}
    m3 = follow(m2, r2, "lower")
    join = in_background(lambda: ask(client, m3, max_tokens=IN_FLIGHT_TOKENS))
    preempt(proxy, engine, c)
    before = engine.requests_total()
    proxy.resume()  # no version: the proxy reads /get_model_info and the pre-check sees c
    with pytest.raises(openai.APIStatusError) as info:
        join()
    expected = check_span([a, b], [c], 1, sid)
    assert expected is not None
    assert info.value.status_code == 502
    body = info.value.response.json()
    assert body["detail"] == expected.detail(), "rein's detail (code, message, span fields) beside OpenAI's error"
    assert body["error"]["code"] == "partial_rollout_staleness_exceeded" and body["error"]["type"] == "server_error"
    assert engine.requests_total() == before  # the continuation was never sent
    chunks = chunks_of(proxy, 3)
    assert [ch.finish_reason for ch in chunks][-1] == "abort"
    rejected = rejected_of(proxy)
    assert rejected.error == "partial_rollout_staleness_exceeded" and rejected.num_chunks == 3
    assert rejected.detail == expected.detail()
    with pytest.raises(openai.ConflictError):
        ask(client, m3)
    assert proxy.finish(sid).status_code == 409


def test_max_preempts_0_rejects_first_switch_after_the_chunk(engine: Engine, proxy_factory: ProxyFactory) -> None:
    a, b = labels(2)
    proxy, sid, client = session_on(engine, proxy_factory, a, max_preempts=0)
    r1 = ask(client, USER)
    engine.load(b)  # the proxy does not know yet: it finds out from the next chunk
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, follow(USER, r1))
    detail = info.value.response.json()["detail"]
    assert info.value.status_code == 502
    assert detail["error"] == "partial_rollout_staleness_exceeded"
    assert (detail["versions"], detail["version_span"], detail["version_switches"]) == ([a, b], 2, 1)
    assert (detail["max_preempts"], detail["max_version_span"], detail["session_id"]) == (0, 1, sid)
    assert len(chunks_of(proxy, 2)) == 2
    assert rejected_of(proxy).num_chunks == 2


def test_pre_check_rejects_when_cap_already_exhausted(engine: Engine, proxy_factory: ProxyFactory) -> None:
    a, b = labels(2)
    proxy, _, client = session_on(engine, proxy_factory, a, max_preempts=0)
    r1 = ask(client, USER)
    engine.load(b)
    assert proxy.resume(b)["status"] == "already_running"  # the broadcaster tells the proxy the new label
    before = engine.requests_total()
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, follow(USER, r1))
    assert info.value.status_code == 502
    assert info.value.response.json()["detail"]["versions"] == [a, b]
    assert engine.requests_total() == before
    assert rejected_of(proxy).num_chunks == 1


def test_unlimited_never_rejects(engine: Engine, proxy_factory: ProxyFactory) -> None:
    a, b, c = labels(3)
    proxy, _, client = session_on(engine, proxy_factory, a)
    r1 = ask(client, USER)
    engine.load(b)
    m2 = follow(USER, r1)
    r2 = ask(client, m2)
    m3 = follow(m2, r2)
    join = in_background(lambda: ask(client, m3, max_tokens=IN_FLIGHT_TOKENS))
    preempt(proxy, engine, c)
    proxy.resume(c)
    join()
    assert [ch.version for ch in chunks_of(proxy, 4)] == [a, b, b, c]


def test_unknown_versions_never_count(engine: Engine, proxy_factory: ProxyFactory) -> None:
    (a,) = labels(1)
    proxy, _, client = session_on(engine, proxy_factory, a, max_preempts=0)
    r1 = ask(client, USER)
    engine.load("unknown")
    m2 = follow(USER, r1)
    r2 = ask(client, m2)
    engine.load(" -1 ")
    m3 = follow(m2, r2)
    join = in_background(lambda: ask(client, m3, max_tokens=IN_FLIGHT_TOKENS))
    preempt(proxy, engine, a)
    proxy.resume()
    join()
    assert [ch.version for ch in chunks_of(proxy, 4)] == [a, None, None, a]


def test_partial_rollout_off_version_change(engine: Engine, proxy_factory: ProxyFactory) -> None:
    a, b = labels(2)
    proxy, _, client = session_on(engine, proxy_factory, a, partial_rollout=False)
    r1 = ask(client, USER)
    engine.load(b)
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, follow(USER, r1))
    assert info.value.status_code == 502
    detail = info.value.response.json()["detail"]
    assert detail["error"] == "trajectory_version_changed" and detail["new_versions"] == [b]
    assert rejected_of(proxy).error == "trajectory_version_changed"


def test_partial_rollout_off_preempt(engine: Engine, proxy_factory: ProxyFactory) -> None:
    (a,) = labels(1)
    proxy, _, client = session_on(engine, proxy_factory, a, partial_rollout=False)
    join = in_background(lambda: ask(client, USER, max_tokens=IN_FLIGHT_TOKENS))
    wait_until(generating(proxy, engine, 2), what="a generation in flight")
    assert proxy.pause()["quiesced"] is True
    with pytest.raises(openai.APIStatusError) as info:
        join()  # answered without waiting for resume
    assert info.value.status_code == 502
    assert info.value.response.json()["detail"]["error"] == "generation_preempted"
    (chunk,) = chunks_of(proxy, 1)
    assert chunk.finish_reason == "abort"
    rejected = rejected_of(proxy)
    assert rejected.error == "generation_preempted" and rejected.num_chunks == 1
    proxy.resume()


@pytest.mark.parametrize("stream", [False, True])
def test_soft_reject_gives_empty_assistant_message(engine: Engine, proxy_factory: ProxyFactory, stream: bool) -> None:
    a, b = labels(2)
    proxy, sid, client = session_on(engine, proxy_factory, a, max_preempts=0, headers={"X-Rein-Soft-Reject": "1"})
    r1 = ask(client, USER)
    engine.load(b)
    m2 = follow(USER, r1)
    if stream:
        frames = list(ask(client, m2, stream=True))
        assert frames[0].choices[0].delta.role == "assistant"
        assert "".join(f.choices[0].delta.content or "" for f in frames) == ""
        assert frames[-1].choices[0].finish_reason == "stop"
    else:
        resp = ask(client, m2)
        assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == ""
        assert resp.choices[0].finish_reason == "stop"
    rejected = rejected_of(proxy)
    assert rejected.error == "partial_rollout_staleness_exceeded" and rejected.session_id == sid
    with pytest.raises(openai.ConflictError):
        ask(client, m2)


def test_abort_after_natural_stop_does_not_extend(engine: Engine, proxy_factory: ProxyFactory) -> None:
    (a,) = labels(1)
    engine.load(a)
    shim = NaturalStopShim(engine.url)
    server = ServerThread(shim.app, free_port())
    server.start()
    try:
        proxy = proxy_factory([server.url])
        client = proxy.client(f"s-{uuid.uuid4().hex}", "g")
        join = in_background(lambda: ask(client, USER, max_tokens=3))
        wait_until(shim.generated.is_set, what="the engine to finish naturally")
        paused = proxy.pause()
        assert paused["quiesced"] is True and paused["preempted"] == [] and len(shim.aborts) == 1
        proxy.resume()
        resp = join()
        (chunk,) = chunks_of(proxy, 1)
        assert chunk.finish_reason == "length" and len(chunk.output_ids) == 3
        assert rein(resp)["output_ids"] == chunk.output_ids and resp.choices[0].finish_reason == "length"
        assert shim.generate_calls == 1
    finally:
        server.stop()


def test_weights_swapped_mid_request_give_per_token_versions_on_the_chunk(
    engine: Engine, proxy_factory: ProxyFactory
) -> None:
    """An engine updated without a pause (a manual update, a proxy missing from the broadcaster's
    list) keeps decoding with the new weights: the chunk record carries each token's version as the
    engine reported it, not one label for all."""
    a, b = labels(2)
    engine.load(a)
    b_path, _ = engine.checkpoint(b)
    proxy = proxy_factory([engine.url])
    client = proxy.client(f"s-{uuid.uuid4().hex}", "g")
    join = in_background(lambda: ask(client, USER, max_tokens=IN_FLIGHT_TOKENS))
    wait_until(generating(proxy, engine, 3), what="a generation in flight")
    engine.load(b, path=b_path)  # no pause, no abort: the request goes on under b
    join()
    [chunk] = chunks_of(proxy, 1)
    assert chunk.finish_reason == "length" and len(chunk.output_ids) == IN_FLIGHT_TOKENS
    assert [label for label, _ in chunk.token_versions] == [a, b], chunk.token_versions
    assert chunk.output_versions()[0] == a and chunk.output_versions()[-1] == b
    assert chunk.version == b  # the label the engine reported when it answered


@pytest.mark.parametrize("bulk", [True, False], ids=["rein", "sglang"])
def test_pause_aborts_every_generation_in_one_call(engine: Engine, proxy_factory: ProxyFactory, bulk: bool) -> None:
    """Three generations in flight: rein's engine gets one ``/abort_requests`` naming all three; an
    engine without it (404) gets one ``/abort_request`` each, and is not asked in bulk again."""
    (a,) = labels(1)
    engine.load(a)
    front = CountingFront(engine.url, bulk)
    server = ServerThread(front.app, free_port())
    server.start()
    try:
        proxy = proxy_factory([server.url])
        joins = [in_background(lambda i=i: ask(proxy.client(f"s{i}-{uuid.uuid4().hex}", "g"), USER,  # type: ignore[misc]
                                               max_tokens=IN_FLIGHT_TOKENS)) for i in range(3)]

        def all_generating() -> bool:
            rids = set(proxy.state()["active_rids"])
            return len(rids) == 3 and all(
                r["completion_tokens"] >= 2 for r in engine.active() if r["rid"] in rids
            ) and rids <= {r["rid"] for r in engine.active()}

        for _ in range(2):
            wait_until(all_generating, what="three generations in flight")
            paused = proxy.pause()
            assert paused["quiesced"] is True and len(paused["preempted"]) == 3
            proxy.resume()
        for join in joins:
            assert join().choices[0].finish_reason == "length"
        if bulk:
            assert front.calls.get("/abort_requests") == 2 and "/abort_request" not in front.calls
        else:
            assert front.calls.get("/abort_requests") == 1 and front.calls.get("/abort_request") == 6
    finally:
        server.stop()
