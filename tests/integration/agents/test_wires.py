"""The Responses and Messages wires on the one session machine: the official ``openai`` client's
``responses.create`` and the ``anthropic`` client's ``messages.create`` each complete a tool round trip
through the proxy, whole and streamed, on a scripted engine (exact ids), and record the same ids the
chat-completions wire records: the second turn continues from the sampled ids."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import openai
import pytest

from services.rollout.calculator import TOOLS
from tests.support.proxy import proxy_factory
from tests.support.scripted_agent import ANSWER_TEXT, QUESTION, Scripted, calculator, scripted
from tests.support.sglang_engine import sglang

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
