"""Tokens in, tokens out with a Hugging Face tokenizer: openai client -> proxy -> engine, both on
``REIN_MODEL=<tiny Llama with the SmolLM2 tokenizer and chat template>``, records on real Kafka.

A three-turn conversation in several scripts, sampled at temperature 1: every chunk holds the ids the
engine sampled, verbatim (the model's logprobs of the recorded sequence equal the engine's, so the
engine saw exactly these ids as prompts and sampled exactly these outputs), each turn's context is the
template's delta (the ids so far spell exactly the template's text), the segment never restarts,
and an edited history starts a new one rendered in full.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.model import load_family
from shared.model.compute import token_logprobs
from shared.model.hf_chat import HFChatTokenizer
from shared.schemas import Chunk, SessionFinished
from tests.support.proxy import ProxyFactory, proxy_factory, rein
from tests.support.stack import Engine, temp_engine

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory"]

USERS = ["Bonjour ! Ça va ? 😀", "你好，世界。こんにちは 👋🏽", "Ünïcödé e\u0301 — ﬁn 🇫🇷"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hf_engine(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with temp_engine(tmp_path_factory, extra_env={"REIN_MODEL": str(tiny_llama_dir)}) as engine:
        yield engine


def test_multi_turn_non_ascii_keeps_sampled_ids_and_appends_template_deltas(
    hf_engine: Engine, proxy_factory: ProxyFactory, tiny_llama_dir: Path,
) -> None:
    tok = load_family(str(tiny_llama_dir)).tokenizer
    assert isinstance(tok, HFChatTokenizer)
    proxy = proxy_factory([hf_engine.url], model=str(tiny_llama_dir))
    sid, gid = f"s-{uuid.uuid4().hex}", f"g-{uuid.uuid4().hex}"
    client = proxy.client(sid, gid)
    messages: list[dict[str, str]] = [{"role": "system", "content": "Réponds brièvement. 🙂"}]
    asked: list[list[dict[str, str]]] = []
    outputs: list[list[int]] = []
    for turn, text in enumerate(USERS):
        messages.append({"role": "user", "content": text})
        asked.append(list(messages))
        resp = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                              temperature=1.0)
        info = rein(resp)
        assert (info["segment_index"], info["new_segment"]) == (0, turn == 0)
        content = resp.choices[0].message.content or ""
        assert content == tok.decode(info["output_ids"])  # the answer is the text of the sampled ids
        assert resp.choices[0].finish_reason == ("stop" if info["output_ids"][-1] in tok.stop_ids else "length")
        outputs.append(info["output_ids"])
        messages.append({"role": "assistant", "content": content})

    chunks = [r for r in proxy.records("chunks", 3) if isinstance(r, Chunk)]
    assert [(c.seq, c.segment_index, c.chunk_index) for c in chunks] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert [c.output_ids for c in chunks] == outputs
    assert chunks[0].context_ids == tok.encode_chat(asked[0], add_generation_prompt=True)
    sequence: list[int] = []
    for chunk, conversation, text in zip(chunks, asked, USERS, strict=True):
        sequence += chunk.context_ids
        # the ids so far (earlier sampled ids verbatim, then this turn's delta) spell the template's text
        assert tok._text(sequence) == tok.render_chat(conversation, add_generation_prompt=True)
        assert text in tok._text(chunk.context_ids)
        sequence += chunk.output_ids
    # the model's logprobs of the recorded sequence are the engine's: it saw these prompts, sampled these ids
    family = load_family(str(tiny_llama_dir))
    model = family.new_model(0, torch.device("cpu"))
    with torch.no_grad():
        logp = token_logprobs(model, torch.tensor([sequence]))[0]
    at = 0
    for chunk in chunks:
        at += len(chunk.context_ids)
        mine = logp[at - 1 : at - 1 + len(chunk.output_ids)].tolist()
        assert mine == pytest.approx(chunk.logprobs, abs=1e-4)
        at += len(chunk.output_ids)

    edited = [messages[0], {"role": "user", "content": "Autre question ? 🤔"}, *messages[2:]]
    resp = client.chat.completions.create(model="m", messages=edited, max_tokens=2)  # type: ignore[arg-type]
    assert (rein(resp)["segment_index"], rein(resp)["new_segment"]) == (1, True)
    (fourth,) = [r for r in proxy.records("chunks", 4) if isinstance(r, Chunk)][3:]
    assert fourth.segment_index == 1 and fourth.context_ids == tok.encode_chat(edited, add_generation_prompt=True)

    assert proxy.finish(sid).json()["num_chunks"] == 4
    (finished,) = proxy.records("events", 1)
    assert isinstance(finished, SessionFinished) and finished.num_chunks == 4


def test_image_parts_are_refused_with_a_clear_400(hf_engine: Engine, proxy_factory: ProxyFactory,
                                                  tiny_llama_dir: Path) -> None:
    proxy = proxy_factory([hf_engine.url], model=str(tiny_llama_dir))
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    r = proxy.runner.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "img"})
    assert r.status_code == 400, r.text
    assert r.json()["detail"]["error"] == "unsupported_content"
    assert r.json()["detail"]["field"] == "messages.0.content.1"
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    ok = {"model": "m", "max_tokens": 2, "tools": tools, "messages": [{"role": "tool", "tool_call_id": "c1",
                                                                       "content": "5"}]}
    r = proxy.runner.post("/v1/chat/completions", json=ok, headers={"X-Session-Id": "tool"})
    assert r.status_code == 200, r.text
