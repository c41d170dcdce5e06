"""The Responses and Messages wires on the one session machine: the official ``openai`` client's
``responses.create`` and the ``anthropic`` client's ``messages.create`` each complete a tool round trip
through the proxy, whole and streamed, on a scripted engine (exact ids), and record the same ids the
chat-completions wire records: the second turn continues from the sampled ids."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from services.rollout.calculator import TOOLS
from tests.support.proxy import ProxyFactory, in_background, proxy_factory
from tests.support.scripted_agent import ANSWER_TEXT, QUESTION, Scripted, calculator, scripted
from tests.support.sglang_engine import ScriptedServers, sglang
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
