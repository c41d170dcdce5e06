"""The Responses and Messages wires on the one session machine: the official ``openai`` client's
``responses.create`` and the ``anthropic`` client's ``messages.create`` each complete a tool round trip
through the proxy, whole and streamed, on a scripted engine (exact ids), and record the same ids the
chat-completions wire records: the second turn continues from the sampled ids."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from services.rollout.calculator import TOOLS
from shared.model.hf import HFFamily
from shared.model.hf_chat import HFChatTokenizer
from shared.schemas import Chunk
from tests.support.proxy import ProxyFactory, in_background, proxy_factory
from tests.support.scripted_agent import ANSWER_TEXT, QUESTION, Scripted, calculator, scripted
from tests.support.sglang_engine import ScriptedServers, sglang
from tests.support.templates import qwen3_style
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory", "scripted", "sglang"]

FUNCTION = TOOLS[0]["function"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_responses_api_round_trips_a_tool_call_token_exact(scripted: Scripted, stream: bool) -> None:
    opened = scripted.open(f"g-{uuid.uuid4().hex}")
    client = openai.OpenAI(base_url=f"{scripted.proxy.url}/v1", api_key=opened["api_key"], max_retries=0, timeout=60)
    tools: Any = [{"type": "function", "name": FUNCTION["name"], "description": FUNCTION["description"],
                   "parameters": FUNCTION["parameters"]}]
    items: list[Any] = [{"role": "user", "content": QUESTION}]

    def create() -> Any:
        if not stream:
            return client.responses.create(model="m", instructions="Be careful.", input=items, tools=tools,
                                           max_output_tokens=200, store=False)
        with client.responses.stream(model="m", instructions="Be careful.", input=items, tools=tools,
                                     max_output_tokens=200, store=False) as events:
            kinds = [event.type for event in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
            return events.get_final_response()

    first = create()
    assert first.status == "completed" and first.output_text == "Let me compute."
    [call] = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "417 * 38"})
    items += [item.model_dump(exclude_none=True) for item in first.output]  # what a Responses tool loop sends back
    items.append({"type": "function_call_output", "call_id": call.call_id,
                  "output": calculator(**json.loads(call.arguments))})
    second = create()
    assert second.output_text == ANSWER_TEXT and all(item.type == "message" for item in second.output)
    scripted.assert_token_exact()
    client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_messages_api_round_trips_a_tool_call_token_exact(scripted: Scripted, stream: bool) -> None:
    opened = scripted.open(f"g-{uuid.uuid4().hex}")
    client = anthropic.Anthropic(base_url=opened["anthropic_base_url"], api_key="unused", max_retries=0, timeout=60)
    tools: Any = [{"name": FUNCTION["name"], "description": FUNCTION["description"],
                   "input_schema": FUNCTION["parameters"]}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]

    def create() -> Any:
        if not stream:
            return client.messages.create(model="m", system="Be careful.", messages=messages, tools=tools,
                                          max_tokens=200)
        with client.messages.stream(model="m", system="Be careful.", messages=messages, tools=tools,
                                    max_tokens=200) as events:
            return events.get_final_message()

    first = create()
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert (text.type, text.text) == ("text", "Let me compute.")
    assert (call.type, call.name, call.input) == ("tool_use", "calculator", {"expression": "417 * 38"})
    messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": calculator(**call.input)}]})
    second = create()
    assert second.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in second.content] == [("text", ANSWER_TEXT)]
    scripted.assert_token_exact()
    client.close()


def test_the_wires_refuse_what_they_cannot_honour(scripted: Scripted) -> None:
    opened = scripted.open(f"g-{uuid.uuid4().hex}")
    client = openai.OpenAI(base_url=f"{scripted.proxy.url}/v1", api_key=opened["api_key"], max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input="hi", previous_response_id="resp_1")
    assert refused.value.body["detail"]["error"] == "unsupported_parameter"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    assert refused.value.body["detail"]["fields"][0]["field"] == "tools.0"  # type: ignore[index]
    client.close()
    claude = anthropic.Anthropic(base_url=scripted.proxy.url, api_key=opened["api_key"], max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as image:
        claude.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert image.value.body["detail"]["error"] == "unsupported_content"  # type: ignore[index]
    claude.close()
    assert scripted.engine.generate_bodies == [], "nothing refused reached the engine"


# --------------------------------------------------------------------------- each wire's own errors


def test_each_wire_answers_a_context_overflow_in_its_own_shape(sglang: ScriptedServers, proxy_factory: ProxyFactory,
                                                               tiny_llama_dir: Path) -> None:
    """What agents catch to compact their history: OpenAI's 400 ``context_length_exceeded`` and Anthropic's 400
    ``invalid_request_error``, each client raising its own error with rein's detail inside."""
    engine, url = sglang(max_req_input_len=40)
    proxy = proxy_factory([url], model=str(tiny_llama_dir))
    opened = proxy.open(f"g-{uuid.uuid4().hex}")
    long = "guess " * 60
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=opened["api_key"], max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": long}], max_tokens=5)
    assert chat.value.code == "context_length_exceeded" and chat.value.type == "invalid_request_error"
    assert chat.value.body["detail"]["error"] == "context_overflow"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model="m", input=long, max_output_tokens=5)
    assert responses.value.code == "context_length_exceeded"
    client.close()
    claude = anthropic.Anthropic(base_url=opened["anthropic_base_url"], api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": long}])
    assert messages.value.status_code == 400 and messages.value.type == "invalid_request_error"  # type: ignore[attr-defined]
    assert messages.value.body["detail"]["error"] == "context_overflow"  # type: ignore[index]
    claude.close()
    assert engine.generate_bodies == [], "refused before the engine"


def test_a_streamed_responses_failure_ends_with_response_failed(sglang: ScriptedServers, proxy_factory: ProxyFactory,
                                                                tiny_llama_dir: Path) -> None:
    """A weight update preempts a streamed Responses call already answered 200 (partial rollout off): the
    stream ends with ``response.failed`` carrying rein's error, not a stream without ``response.completed``."""
    engine, url = sglang(max_req_input_len=4000, token_delay_s=0.01, stall_after=1)
    proxy = proxy_factory([url], model=str(tiny_llama_dir), partial_rollout=False, stream_heartbeat_s=0.05)
    opened = proxy.open(f"g-{uuid.uuid4().hex}")
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=opened["api_key"], max_retries=0, timeout=60)
    join = in_background(lambda: list(client.responses.create(model="m", input="hi", max_output_tokens=20,
                                                              stream=True)))
    wait_until(lambda: any(r.output_ids for r in engine.running.values()), what="a generation in flight")
    proxy.pause()
    events = join()
    proxy.resume()
    assert events[-1].type == "response.failed", [e.type for e in events]
    assert events[-1].response.status == "failed"
    assert events[-1].response.error.code == "generation_preempted"  # type: ignore[union-attr]
    client.close()


# --------------------------------------------------------------------------- a reasoning model on each wire

THINKING_SCRIPT = [
    '<think>\nI need the tool.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
    '"417 * 38"}}\n</tool_call>',
    f"<think>\nThe tool said 15846.\n</think>\n\n{ANSWER_TEXT}",
]


@pytest.fixture
def qwen3_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama's directory with a Qwen3-style tokenizer and template (the proxy loads only the tokenizer)."""
    out = tmp_path / "qwen3-style"
    shutil.copytree(tiny_llama_dir, out)
    qwen3_style(tiny_llama_dir).inner.save_pretrained(out)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
def test_a_reasoning_models_thinking_on_each_wire_and_back_token_exact(
    sglang: ScriptedServers, proxy_factory: ProxyFactory, qwen3_dir: Path, wire: str, stream: bool,
) -> None:
    """``<think>…</think>`` is chat's ``reasoning_content``, a Responses ``reasoning`` item, a Messages
    ``thinking`` block; each client sends it back as it does (the whole message, the items, the blocks) and
    the next turn continues from the sampled ids."""
    tok = HFFamily(qwen3_dir).tokenizer
    assert isinstance(tok, HFChatTokenizer) and tok.reasoning is not None
    end = tok.inner.convert_tokens_to_ids("<|im_end|>")
    script = [[*tok.inner.encode(text, add_special_tokens=False), end] for text in THINKING_SCRIPT]
    engine, url = sglang(max_req_input_len=4000, token_delay_s=0.0, script=[list(s) for s in script])
    proxy = proxy_factory([url], model=str(qwen3_dir))
    opened = proxy.open(f"g-{uuid.uuid4().hex}")
    thoughts: list[str | None] = []
    if wire == "chat":
        client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0, timeout=60)
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        tools: Any = TOOLS
        for turn in range(2):
            if stream:
                chunks = list(client.chat.completions.create(model="m", messages=messages, tools=tools, stream=True))
                thought = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                                  for c in chunks if c.choices)
                message: Any = {"role": "assistant", "content": "".join(c.choices[0].delta.content or ""
                                                                      for c in chunks if c.choices) or None}
                calls = [d.model_dump() for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
                if calls:
                    message["tool_calls"] = [{k: v for k, v in d.items() if k != "index"} for d in calls]
            else:
                reply = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
                thought = (reply.model_extra or {}).get("reasoning_content")
                message = reply.model_dump(exclude_none=True)  # reasoning_content included: sent back
            thoughts.append(thought)
            messages.append(message)
            if turn == 0:
                messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "15846"})
        assert messages[-1]["content"] == ANSWER_TEXT
    elif wire == "responses":
        client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0, timeout=60)
        items: list[Any] = [{"role": "user", "content": QUESTION}]
        flat: Any = [{"type": "function", **FUNCTION}]
        for turn in range(2):
            if stream:
                with client.responses.stream(model="m", input=items, tools=flat, store=False) as events:
                    response = events.get_final_response()
            else:
                response = client.responses.create(model="m", input=items, tools=flat, store=False)
            [reasoning] = [item for item in response.output if item.type == "reasoning"]
            thoughts.append(reasoning.content[0].text if reasoning.content else None)
            items += [item.model_dump(exclude_none=True) for item in response.output]
            if turn == 0:
                [call] = [item for item in response.output if item.type == "function_call"]
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": "15846"})
        assert response.output_text == ANSWER_TEXT
    else:
        claude = anthropic.Anthropic(base_url=opened["anthropic_base_url"], api_key="unused", max_retries=0,
                                     timeout=60)
        history: list[Any] = [{"role": "user", "content": QUESTION}]
        schema: Any = [{"name": FUNCTION["name"], "description": FUNCTION["description"],
                        "input_schema": FUNCTION["parameters"]}]
        for turn in range(2):
            kwargs: Any = {"model": "m", "max_tokens": 200, "messages": history, "tools": schema,
                           "thinking": {"type": "enabled", "budget_tokens": 100}}
            if stream:
                with claude.messages.stream(**kwargs) as events:
                    reply = events.get_final_message()
            else:
                reply = claude.messages.create(**kwargs)
            [thinking] = [block for block in reply.content if block.type == "thinking"]
            thoughts.append(thinking.thinking)
            history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            if turn == 0:
                [use] = [block for block in reply.content if block.type == "tool_use"]
                history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                             "content": "15846"}]})
        assert reply.content[-1].type == "text" and reply.content[-1].text == ANSWER_TEXT  # type: ignore[union-attr]
    assert thoughts == ["I need the tool.", "The tool said 15846."]
    chunks = [r for r in proxy.records("chunks", 2) if isinstance(r, Chunk)]
    assert [c.output_ids for c in chunks] == script and [c.segment_index for c in chunks] == [0, 0]
    first, second = engine.generate_bodies[:2]
    assert second["input_ids"] == [*first["input_ids"], *script[0], *chunks[1].context_ids], "token-exact"
