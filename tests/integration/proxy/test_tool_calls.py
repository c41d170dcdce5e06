"""A tool round trip through the proxy with the official openai client, on a scripted engine (exact ids):
the reply's call text comes back as ``tool_calls``, the client sends them back (its own serialization)
with the tool's result, and the session goes on from the ids sampled, token-exact."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from ops.demo_metrics import proxy_tool_calls
from services.rollout.calculator import CalculatorEpisode
from shared.model.hf import HFFamily
from shared.model.hf_chat import HFChatTokenizer
from shared.schemas import Chunk
from tests.support.proxy import ProxyFactory, proxy_factory, rein
from tests.support.sglang_engine import ScriptedServers, sglang

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory", "sglang"]


def test_the_openai_clients_tool_loop_round_trips_token_exact(
    sglang: ScriptedServers, proxy_factory: ProxyFactory, tiny_llama_dir: Path
) -> None:
    tok = HFFamily(tiny_llama_dir).tokenizer
    assert isinstance(tok, HFChatTokenizer)
    end = tok.inner.convert_tokens_to_ids("<|im_end|>")
    call_text = ('Let me compute.\n<tool_call>[{"name": "calculator", "arguments": {"expression": "417 * 38"}}]'
                 "</tool_call>")
    script = [[*tok.inner.encode(call_text, add_special_tokens=False), end],
              [*tok.inner.encode("417 * 38 = 15846.\nAnswer: 15846", add_special_tokens=False), end]]
    engine, url = sglang(max_req_input_len=4000, token_delay_s=0.0, script=[list(s) for s in script])
    proxy = proxy_factory([url], model=str(tiny_llama_dir))
    sid = f"s-{uuid.uuid4().hex}"
    client = proxy.client(sid, f"g-{uuid.uuid4().hex}")

    episode = CalculatorEpisode()
    messages: list[Any] = episode.reset({"a": 417, "op": "*", "b": 38})
    first = client.chat.completions.create(model="m", messages=messages, tools=episode.tools,  # type: ignore[arg-type]
                                           max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    [called] = choice.message.tool_calls or []
    assert called.function.name == "calculator"  # type: ignore[union-attr]
    assert rein(first)["output_ids"] == script[0], "the engine's ids, verbatim"
    messages.append(choice.message.model_dump(exclude_none=True))  # what an openai tool loop sends back
    results = episode.step(choice.message.content or "", [c.model_dump() for c in choice.message.tool_calls or []])
    assert results == [{"role": "tool", "tool_call_id": called.id, "content": "15846"}]
    messages.extend(results)

    second = client.chat.completions.create(model="m", messages=messages, tools=episode.tools,  # type: ignore[arg-type]
                                            max_tokens=200)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    info = rein(second)
    assert info["segment_index"] == 0 and info["new_segment"] is False, "continued, not re-rendered"
    assert episode.step(second.choices[0].message.content or "") is None and episode.reward() == 1.0

    chunks = [r for r in proxy.records("chunks", 2) if isinstance(r, Chunk)]
    assert [c.output_ids for c in chunks] == script
    delta = tok.decode(chunks[1].context_ids)
    assert "15846" in delta and "calculator" not in delta, "the second turn adds the tool result only"
    bodies = engine.generate_bodies
    assert bodies[1]["input_ids"] == [*bodies[0]["input_ids"], *script[0], *chunks[1].context_ids]
    scraped = httpx.get(f"{proxy.url}/metrics", timeout=5).text
    counts = proxy_tool_calls(scraped)
    assert counts == {"replies": 2, "replies_with_calls": 1, "malformed": 0, "well_formed_share": 1.0}
