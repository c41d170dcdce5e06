"""Proxy sessions end to end: openai client -> real proxy -> real engine, records on real Kafka.

Covers TITO multi-turn reconstruction, streaming, finish, and every error status.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ops.local.ports import free_port
from shared.names import Topics
from shared.schemas import Chunk, SamplingParams, SessionFinished, SessionRejected
from shared.tokenizer import TOKENIZER as TOK
from tests.support.procs import Proc
from tests.support.proxy import (
    ADMIN,
    RUNNER,
    ProxyFactory,
    count_records,
    proxy_factory,
    rein,
)
from tests.support.sglang_engine import ScriptedServers, sglang
from tests.support.stack import Engine, proxy_process, temp_engine
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory", "sglang"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with temp_engine(tmp_path_factory, step_delay_s=0.0) as engine:
        yield engine


def test_multi_turn_chunks_reconstruct_engine_tokens(engine: Engine, proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([engine.url])
    sid, gid = f"s-{uuid.uuid4().hex}", f"g-{uuid.uuid4().hex}"
    client = proxy.client(sid, gid, **{"X-Prompt-Id": "p-7", "X-Attempt": "1", "X-Turn-Id": "t"})
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "guess the number"},
        {"role": "user", "content": "guess"},
    ]
    outputs: list[list[int]] = []
    # each call's own sampling parameters are recorded on its chunk (the trainer scores with them)
    sampling = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_k=5),
                SamplingParams(temperature=0.0)]
    for turn, user in enumerate(["higher", "lower", None]):
        resp = client.chat.completions.create(
            model="rein-tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=sampling[turn].temperature,
            top_p=sampling[turn].top_p,
            extra_body={"top_k": sampling[turn].top_k},
        )
        info = rein(resp)
        assert info["segment_index"] == 0 and info["new_segment"] == (turn == 0)
        outputs.append(info["output_ids"])
        content = resp.choices[0].message.content or ""
        assert content == TOK.decode(info["output_ids"])
        messages.append({"role": "assistant", "content": content})
        if user is not None:
            messages.append({"role": "user", "content": user})

    chunks = [r for r in proxy.records("chunks", 3) if isinstance(r, Chunk)]
    assert [c.seq for c in chunks] == [0, 1, 2]
    assert all(
        (c.session_id, c.group_id, c.prompt_id, c.attempt, c.turn_id) == (sid, gid, "p-7", 1, "t") for c in chunks
    )
    assert [c.output_ids for c in chunks] == outputs
    assert all(c.chunk_index == 0 and c.segment_index == 0 and c.version == "v0" for c in chunks)
    assert all(len(c.logprobs) == len(c.output_ids) for c in chunks)
    assert len({c.rid for c in chunks}) == 3
    assert [c.sampling for c in chunks] == sampling
    assert chunks[2].logprobs == [0.0] * len(chunks[2].output_ids)  # greedy: each token had probability 1

    # Independent expectation: first turn = chat template; later turns = new messages + header.
    expected = TOK.apply_chat_template(messages[:2], add_generation_prompt=True)
    assert chunks[0].context_ids == expected
    for turn in (1, 2):
        prev = outputs[turn - 1]
        closing = [] if prev and prev[-1] == TOK.end_id else [TOK.end_id]
        user = messages[2 * turn + 1]
        assert chunks[turn].context_ids == [*closing, *TOK.render_message("user", user["content"]), TOK.assistant_id]
    # The engine, asked directly (greedy) for the reconstructed prefix, produces the last chunk again.
    sequence = [t for c in chunks for t in (*c.context_ids, *c.output_ids)]
    prefix = sequence[: len(sequence) - len(chunks[-1].output_ids)]
    direct = httpx.post(
        f"{engine.url}/generate",
        json={"input_ids": prefix, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
        timeout=30,
    ).json()
    assert direct["output_ids"] == chunks[-1].output_ids

    r = proxy.finish(sid, reward=0.5)
    assert r.status_code == 200 and r.json()["num_chunks"] == 3
    (finished,) = proxy.records("events", 1)
    assert isinstance(finished, SessionFinished)
    assert (finished.session_id, finished.group_id, finished.reward, finished.num_chunks) == (sid, gid, 0.5, 3)
    assert proxy.finish(sid).status_code == 409
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model="m", messages=messages, max_tokens=2)  # type: ignore[arg-type]


def test_rewritten_history_starts_new_segment_and_stream(engine: Engine, proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([engine.url])
    sid, gid = f"s-{uuid.uuid4().hex}", "g1"
    client = proxy.client(sid, gid)
    first = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "guess"}], max_tokens=3)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "number"}], max_tokens=3, stream=True
    )
    pieces = list(stream)
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    chunks = [r for r in proxy.records("chunks", 2) if isinstance(r, Chunk)]
    assert [c.segment_index for c in chunks] == [0, 1]
    assert chunks[1].context_ids == TOK.apply_chat_template([{"role": "user", "content": "number"}], True)
    assert text == TOK.decode(chunks[1].output_ids)
    assert first.choices[0].message.content == TOK.decode(chunks[0].output_ids)


def test_session_without_group_is_served_but_not_published(engine: Engine, proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([engine.url])
    sid = f"s-{uuid.uuid4().hex}"
    resp = proxy.client(sid).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "guess"}], max_tokens=2
    )
    assert resp.choices[0].message.role == "assistant"
    assert proxy.finish(sid).json()["published"] is False
    assert count_records(proxy.bootstrap, proxy.settings.topics.chunks) == 0
    assert count_records(proxy.bootstrap, proxy.settings.topics.events) == 0
    # positive control: the same call with a group id is counted on the same topics
    grouped = f"s-{uuid.uuid4().hex}"
    proxy.client(grouped, "g1").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "guess"}], max_tokens=2
    )
    assert proxy.finish(grouped).json()["published"] is True
    assert count_records(proxy.bootstrap, proxy.settings.topics.chunks) == 1
    assert count_records(proxy.bootstrap, proxy.settings.topics.events) == 1


def test_models_health_metrics(engine: Engine, proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([engine.url])
    models = proxy.client("x").models.list()
    assert [m.id for m in models.data] == ["rein-tiny"]
    assert httpx.get(f"{proxy.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{proxy.url}/metrics").text
    assert "rein_proxy_requests_total" in text and "rein_proxy_paused 0.0" in text


def test_an_agent_with_only_a_base_url_and_a_key_is_recorded_as_the_session_it_was_given(
    engine: Engine, proxy_factory: ProxyFactory
) -> None:
    """The two schemes for black-box agents: the API key as the session, and a per-session base URL.
    The runner's side opens each session (group, prompt, attempt) and finishes it by the same key."""
    proxy = proxy_factory([engine.url])
    gid = f"g-{uuid.uuid4().hex}"
    opened = [proxy.open(gid, prompt_id="p-3", attempt=1) for _ in range(2)]
    by_key = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=opened[0]["api_key"], max_retries=0, timeout=120)
    by_url = openai.OpenAI(base_url=opened[1]["base_url"], api_key="anything", max_retries=0, timeout=120)
    assert [m.id for m in by_url.models.list().data] == ["rein-tiny"]
    for client in (by_key, by_url):
        resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "guess"}], max_tokens=2)
        assert resp.choices[0].message.content is not None
    for session in opened:  # finished by the key, by whoever ran the agent (the runner's credential)
        r = proxy.runner.post(f"/v1/sessions/{session['api_key']}/finish", json={"reward": 0.5})
        assert r.status_code == 200, r.text
    chunks = [r for r in proxy.records("chunks", 2) if isinstance(r, Chunk)]
    assert sorted((c.session_id, c.group_id, c.prompt_id, c.attempt) for c in chunks) == sorted(
        (o["session_id"], gid, "p-3", 1) for o in opened)
    ends = [r for r in proxy.records("events", 2) if isinstance(r, SessionFinished)]
    assert sorted(e.session_id for e in ends) == sorted(o["session_id"] for o in opened)

    ok = {"model": "m", "messages": [{"role": "user", "content": "guess"}], "max_tokens": 2}
    key = opened[0]["api_key"]
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    with httpx.Client(timeout=30) as http:
        for headers, url in [
            ({"Authorization": "Bearer sk-not-ours"}, f"{proxy.url}/v1/chat/completions"),
            ({"Authorization": f"Bearer {forged}"}, f"{proxy.url}/v1/chat/completions"),
            ({}, f"{proxy.url}/sessions/rein-sk-nope/v1/chat/completions"),
            ({}, f"{proxy.url}/sessions/{forged}/v1/models"),
        ]:
            r = http.request("GET" if url.endswith("models") else "POST", url, json=None if url.endswith("models")
                             else ok, headers=headers)
            assert r.status_code == 401 and r.json()["detail"]["error"] == "unknown_session_key", (url, r.text)
    r = proxy.runner.post("/v1/sessions", json={"prompt_id": "p"})
    assert r.status_code == 422 and "group_id" in [f["field"] for f in r.json()["detail"]["fields"]]


def test_a_session_this_proxy_does_not_hold_is_not_recorded_empty(
    engine: Engine, proxy_factory: ProxyFactory
) -> None:
    """The proxy restarted between the session's last call and its finish (or the balancer moved the key):
    the chunks are on Kafka and the new proxy cannot count them, so it records no end that would claim none;
    404, and the runner ends the session as lost (its group is retried)."""
    before = proxy_factory([engine.url])
    opened = before.open(f"g-{uuid.uuid4().hex}")
    agent = openai.OpenAI(base_url=opened["base_url"], api_key="anything", max_retries=0, timeout=120)
    agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "guess"}], max_tokens=2)
    after = proxy_factory([engine.url], topics=before.settings.topics)  # the same deployment, restarted
    for named in (opened["api_key"], opened["session_id"]):
        r = after.runner.post(f"/v1/sessions/{named}/finish", json={"reward": 1.0})
        assert r.status_code == 404 and r.json()["detail"]["error"] == "session_not_found", r.text
        assert "no end is recorded" in r.json()["detail"]["message"]
    assert count_records(after.bootstrap, after.settings.topics.chunks) == 1
    assert count_records(after.bootstrap, after.settings.topics.events) == 0
    r = before.runner.post(f"/v1/sessions/{opened['api_key']}/finish", json={"reward": 1.0})
    assert r.status_code == 200 and r.json()["num_chunks"] == 1, "the proxy that holds it finishes it"


def test_error_statuses(engine: Engine, proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([engine.url], max_body_bytes=2048)
    url = f"{proxy.url}/v1/chat/completions"
    ok = {"model": "m", "messages": [{"role": "user", "content": "guess"}], "max_tokens": 2}
    with httpx.Client(timeout=30) as http:
        r = http.post(url, json=ok)
        assert r.status_code == 400 and r.json()["detail"]["error"] == "missing_header"

        hdr = {"X-Session-Id": f"s-{uuid.uuid4().hex}", "Authorization": f"Bearer {RUNNER}"}
        bad = {"model": "m", "messages": [{"role": "tool", "content": "x"}]}
        r = http.post(url, json=bad, headers=hdr)
        assert r.status_code == 422
        assert "messages.0.role" in [f["field"] for f in r.json()["detail"]["fields"]]
        r = http.post(url, json={"model": "m", "messages": [], "max_tokens": 0}, headers=hdr)
        assert r.status_code == 422
        assert {"messages", "max_tokens"} <= {f["field"] for f in r.json()["detail"]["fields"]}
        r = http.post(url, content=b"{not json", headers=hdr)
        assert r.status_code == 422 and r.json()["detail"]["fields"][0]["field"] == "body"

        big = {**ok, "messages": [{"role": "user", "content": "guess " * 2000}]}
        r = http.post(url, json=big, headers=hdr)
        assert r.status_code == 413 and r.json()["detail"]["error"] == "request_too_large"

        def chunked() -> Iterator[bytes]:  # no Content-Length: the actual size is counted
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            yield b"guess " * 1000
            yield b'"}]}'

        r = http.post(url, content=chunked(), headers=hdr)
        assert r.status_code == 413

        overflow = {**ok, "messages": [{"role": "user", "content": "guess " * 80}]}
        r = http.post(url, json=overflow, headers=hdr)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # OpenAI's
        detail = r.json()["detail"]
        assert detail["error"] == "context_overflow" and detail["context_window"] == 64
        assert detail["input_tokens"] == 83

        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": ADMIN}):
            for method, path in (
                ("POST", "/v1/rollout/pause"),
                ("POST", "/v1/rollout/resume"),
                ("GET", "/v1/rollout/state"),
            ):
                r = http.request(method, f"{proxy.url}{path}", headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["detail"]["error"] == "unauthorized"

    r = proxy.runner.post("/v1/sessions/nope/finish", json={"reward": 1})
    assert r.status_code == 404 and r.json()["detail"]["error"] == "session_not_found"
    r = proxy.runner.post("/v1/sessions/nope/finish", json={"reward": "high"})
    assert r.status_code == 422

    # the proxy is still healthy after all of that
    assert httpx.get(f"{proxy.url}/health").status_code == 200


def test_engine_unreachable_is_503(proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([f"http://127.0.0.1:{free_port()}"], engine_connect_timeout_s=1.0)
    with pytest.raises(openai.APIStatusError) as info:
        proxy.client("s", "g").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "guess"}], max_tokens=2
        )
    assert info.value.status_code == 503
    assert info.value.response.json()["detail"]["error"] == "engine_unavailable"
    # nothing was published, the session may retry
    assert count_records(proxy.bootstrap, proxy.settings.topics.chunks) == 0


def test_idle_sessions_are_rejected_on_record(engine: Engine, proxy_factory: ProxyFactory) -> None:
    """An agent that vanishes mid-session (a crashed runner) leaves no open group behind."""
    proxy = proxy_factory([engine.url], session_idle_timeout_s=1.0)
    gone, done, untracked = (f"s-{uuid.uuid4().hex}" for _ in range(3))
    ask = [{"role": "user", "content": "guess"}]
    proxy.client(gone, "g-gone").chat.completions.create(model="m", messages=ask, max_tokens=2)
    proxy.client(done, "g-done").chat.completions.create(model="m", messages=ask, max_tokens=2)
    assert proxy.finish(done).status_code == 200
    proxy.client(untracked).chat.completions.create(model="m", messages=ask, max_tokens=2)

    events = proxy.records("events", 2, timeout_s=30)
    rejected = [r for r in events if isinstance(r, SessionRejected)]
    assert [(r.session_id, r.group_id, r.error, r.num_chunks) for r in rejected] == [
        (gone, "g-gone", "session_idle", 1)
    ]
    assert rejected[0].detail["idle_timeout_s"] == 1.0
    assert [r.session_id for r in events if isinstance(r, SessionFinished)] == [done]

    wait_until(lambda: proxy.state()["live_sessions"] == 0, timeout_s=30, what="the untracked session expired")
    with pytest.raises(openai.ConflictError) as info:
        proxy.client(gone, "g-gone").chat.completions.create(model="m", messages=ask, max_tokens=2)
    assert info.value.response.json()["detail"]["outcome"] == "rejected (session_idle)"
    late = proxy.finish(untracked)
    assert late.status_code == 409 and late.json()["detail"]["outcome"] == "rejected (session_idle)"
    assert count_records(proxy.bootstrap, proxy.settings.topics.events) == 2  # no record for the untracked one
    scraped = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    assert 'rein_proxy_rejections_total{error="session_idle",soft="false"} 2.0' in scraped


def test_a_stopping_proxy_cancels_calls_held_by_a_pause_that_never_ends(
    sglang: ScriptedServers, kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """The broadcaster died between pause and resume: SIGTERM must still stop the proxy, and promptly.
    The engine holds its generation until aborted, so the pause always finds it in flight (the tiny engine
    could finish 60 tokens between the test seeing the call active and the pause)."""
    _, engine_url = sglang(stall_after=2)
    with proxy_process(
        [engine_url], kafka_bootstrap, Topics(chunks=unique_topic(), events=unique_topic()), tmp_path,
        admin_token=ADMIN, log_level="info", extra_env={"REIN_STOP_TIMEOUT_S": "4"},
    ) as proxy:
        proc, url = proxy.proc, proxy.url
        took, outcome = _stop_while_a_call_is_held(proc, url, proxy.runner_token)
    assert took < 2 + 5, f"the proxy took {took:.1f}s to stop"
    assert proc.process.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    assert "error" in outcome, f"the held call was not failed: {outcome}"
    assert "timeout graceful shutdown exceeded" in proc.log_path.read_text()


def _stop_while_a_call_is_held(proc: Proc, url: str, runner: str) -> tuple[float, dict[str, object]]:
    """Pause the proxy (and never resume) while a call generates, then SIGTERM it: (seconds to exit, outcome)."""
    admin = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=runner, max_retries=0, timeout=60,
                           default_headers={"X-Session-Id": f"s-{uuid.uuid4().hex}", "X-Group-Id": "g"})
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "guess"}], max_tokens=60)
            outcome["answered"] = True
        except openai.APIError as exc:
            outcome["error"] = exc

    try:
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        wait_until(lambda: admin.get("/v1/rollout/state").json()["active"] == 1, timeout_s=30, what="a generation")
        assert admin.post("/v1/rollout/pause", json={"reason": "test"}).json()["preempted"]  # and no resume
        wait_until(lambda: admin.get("/v1/rollout/state").json()["held"] == 1, timeout_s=30, what="a held call")
        started = time.monotonic()
        proc.process.terminate()
        proc.process.wait(timeout=30)
        took = time.monotonic() - started
        caller.join(timeout=30)
    finally:
        admin.close()
        client.close()
    return took, outcome
