"""The Responses and Messages adapters (pure): requests map onto the chat-completions request the session
machine serves, a ``chat.completion`` body maps back to each wire's answer and streamed events, and what a
wire cannot honour is refused naming the field. The round trips with the real clients are in
``tests/integration/agents/test_wires.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.proxy import messages_api, responses_api
from services.proxy.messages_api import MessagesRequest
from services.proxy.openai_api import ChatRequest, completion
from services.proxy.replies import ForceCall
from services.proxy.responses_api import ResponsesRequest
from shared.errors import UnsupportedContent, UnsupportedParameter

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 * 3"}'}}
TOOL = {"name": "calculator", "description": "evaluate", "parameters": {"type": "object"}}


def chat_body(content: str = "", calls: tuple[dict[str, Any], ...] = (), finish: str = "stop") -> dict[str, Any]:
    return completion(model="m", content=content, finish_reason=finish, prompt_tokens=7, completion_tokens=3,
                      rein={"output_ids": [1, 2, 3]}, tool_calls=calls)


def sse(frames: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in frames:
        event, data = frame.rstrip("\n").split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        out.append((event[7:], json.loads(data[6:])))
    return out


# --------------------------------------------------------------------------- Responses


def test_a_responses_request_is_the_chat_request_of_the_same_turn() -> None:
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0.5, "stream": True,
        "tools": [{"type": "function", **TOOL, "strict": True}], "tool_choice": "auto", "parallel_tool_calls": False,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "2 * 3?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Computing."}]},
            {"type": "function_call", "call_id": "call_1", "name": "calculator",
             "arguments": '{"expression": "2 * 3"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "6"},
        ],
    })
    chat = responses_api.to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2 * 3?"},
        {"role": "assistant", "content": "Computing.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "6"},
    ]
    assert chat["tools"] == [{"type": "function", "function": TOOL}]
    assert (chat["max_tokens"], chat["temperature"], chat["stream"]) == (50, 0.5, True)
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("auto", False)
    ChatRequest.model_validate(chat).refuse_unsupported()


def test_calls_without_a_message_before_them_are_an_assistant_message_of_their_own() -> None:
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
    ]})
    [_, assistant] = responses_api.to_chat(body)["messages"]
    assert assistant["content"] is None and [c["id"] for c in assistant["tool_calls"]] == ["a", "b"]


@pytest.mark.parametrize(("request_body", "field"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format"),
])
def test_responses_parameters_the_proxy_cannot_honour_are_refused(request_body: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedParameter) as refused:
        responses_api.to_chat(ResponsesRequest.model_validate(request_body))
    assert [f["field"] for f in refused.value.fields["fields"]] == [field]


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]},
    {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA..."},  # another server's thinking
])
def test_responses_items_a_text_model_cannot_take_are_refused(item: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedContent):
        responses_api.to_chat(ResponsesRequest.model_validate({"input": [item]}))


@pytest.mark.parametrize(("extra", "refused"), [
    ({"store": False, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"], "user": "u",
      "truncation": "disabled", "reasoning": {"summary": "auto"}, "prompt_cache_key": "k"}, []),
    ({"reasoning": {"effort": "high"}}, ["reasoning.effort"]),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, ["text.verbosity"]),
    ({"truncation": "auto", "background": True}, ["truncation", "background"]),
    ({"prompt": {"id": "pmpt_1"}, "safety_identifier": "s", "top_k": 5}, ["prompt", "top_k"]),
])
def test_responses_fields_are_honoured_harmless_or_refused_by_name(extra: dict[str, Any], refused: list[str]) -> None:
    body = ResponsesRequest.model_validate({"input": "hi", **extra})
    if not refused:
        responses_api.to_chat(body)
        return
    with pytest.raises(UnsupportedParameter) as err:
        responses_api.to_chat(body)
    assert [f["field"] for f in err.value.fields["fields"]] == refused


def test_a_reasoning_models_thinking_is_a_reasoning_item_and_comes_back_as_its_messages_thinking() -> None:
    request = ResponsesRequest.model_validate({"input": "x"})
    chat = completion(model="m", content="Computing.", finish_reason="tool_calls", prompt_tokens=7,
                      completion_tokens=3, tool_calls=(CALL,), reasoning="2 * 3 needs the tool.")
    body = responses_api.answer(chat, request)
    reasoning, _, call = body["output"]
    assert (reasoning["type"], reasoning["content"]) == (
        "reasoning", [{"type": "reasoning_text", "text": "2 * 3 needs the tool."}])
    kinds = [kind for kind, _ in sse(responses_api.events(chat, request))]
    assert kinds[2:6] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.output_item.done"]
    echoed = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "2 * 3?"}, *body["output"],
                                                        {"type": "function_call_output", "call_id": "call_1",
                                                         "output": "6"}]})
    assert responses_api.to_chat(echoed)["messages"][1] == {
        "role": "assistant", "content": "Computing.", "reasoning_content": "2 * 3 needs the tool.",
        "tool_calls": [CALL]}
    calls_only = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "go"}, reasoning, call]})
    assert responses_api.to_chat(calls_only)["messages"][1] == {
        "role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "2 * 3 needs the tool."}


def test_a_chat_completion_is_answered_as_a_response() -> None:
    request = ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", **TOOL}]})
    body = responses_api.answer(chat_body("Computing.", (CALL,), "tool_calls"), request)
    message, call = body["output"]
    assert message["content"] == [{"type": "output_text", "text": "Computing.", "annotations": []}]
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == (
        "function_call", "call_1", "calculator", '{"expression": "2 * 3"}')
    assert (body["object"], body["status"], body["incomplete_details"]) == ("response", "completed", None)
    assert body["usage"]["input_tokens"] == 7 and body["rein"] == {"output_ids": [1, 2, 3]}
    cut = responses_api.answer(chat_body("Comp", finish="length"), request)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def test_a_response_streams_as_the_responses_events() -> None:
    request = ResponsesRequest.model_validate({"input": "x"})
    events = sse(responses_api.events(chat_body("Computing.", (CALL,), "tool_calls"), request))
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[-1][1]["response"]["output"][1]["arguments"] == CALL["function"]["arguments"]


# --------------------------------------------------------------------------- Messages


def test_a_messages_request_is_the_chat_request_of_the_same_turn() -> None:
    body = MessagesRequest.model_validate({
        "metadata": {"user_id": "u"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"},  # harmless
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["\n\n"],
        "tools": [{"name": "calculator", "description": "evaluate", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "2 * 3?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Computing."},
                                              {"type": "tool_use", "id": "call_1", "name": "calculator",
                                               "input": {"expression": "2 * 3"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": [{"type": "text", "text": "6"}]},
                                         {"type": "text", "text": "Go on."}]},
        ],
    })
    chat = messages_api.to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 * 3?"},
        {"role": "assistant", "content": "Computing.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "6"},
        {"role": "user", "content": "Go on."},
    ]
    assert chat["tools"] == [{"type": "function", "function": TOOL}]
    assert (chat["max_tokens"], chat["stop"], chat["tool_choice"], chat["parallel_tool_calls"]) == (
        64, ["\n\n"], "auto", False)
    ChatRequest.model_validate(chat).refuse_unsupported()


@pytest.mark.parametrize(("request_body", "field"), [
    ({"container": "c-1"}, "container"),
    ({"output_config": {"effort": "low"}}, "output_config"),
    ({"presence_penalty": 0.5}, "presence_penalty"),  # not Anthropic's: unknown, refused by name
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0"),
])
def test_messages_parameters_the_proxy_cannot_honour_are_refused(request_body: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedParameter) as refused:
        messages_api.to_chat(MessagesRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                             **request_body}))
    assert [f["field"] for f in refused.value.fields["fields"]] == [field]


@pytest.mark.parametrize(("choice", "forced", "calls"), [
    ({"type": "any"}, ForceCall(), "all"), ({"type": "tool", "name": "calculator"}, ForceCall("calculator"), "all"),
    ({"type": "none"}, None, "none"), ({"type": "auto"}, None, "all"),
])
def test_forcing_a_call_is_served_as_on_the_chat_route(choice: dict[str, Any], forced: ForceCall | None,
                                                       calls: str) -> None:
    chat = ChatRequest.model_validate(messages_api.to_chat(MessagesRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": choice,
         "tools": [{"name": "calculator", "input_schema": {"type": "object"}}]})))
    chat.refuse_unsupported()
    assert (chat.force_call(), chat.tool_calls()) == (forced, calls)


def test_a_reply_that_ended_at_a_stop_sequence_says_which() -> None:
    body = completion(model="m", content="Done", finish_reason="stop", prompt_tokens=1, completion_tokens=2,
                      stop_sequence="\n\nHuman:")
    message = messages_api.answer(body)
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "\n\nHuman:")
    [delta] = [data for kind, data in sse(messages_api.events(body)) if kind == "message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\nHuman:"}
    assert messages_api.answer(chat_body("Done"))["stop_reason"] == "end_turn"


def test_a_reasoning_models_thinking_is_a_thinking_block_and_comes_back_as_its_messages_thinking() -> None:
    chat = completion(model="m", content="It is 6.", finish_reason="stop", prompt_tokens=1, completion_tokens=2,
                      reasoning="2 * 3 = 6")
    message = messages_api.answer(chat)
    assert message["content"] == [{"type": "thinking", "thinking": "2 * 3 = 6", "signature": ""},
                                  {"type": "text", "text": "It is 6."}]
    deltas = [data["delta"] for kind, data in sse(messages_api.events(chat)) if kind == "content_block_delta"]
    assert deltas[0] == {"type": "thinking_delta", "thinking": "2 * 3 = 6"}
    request = MessagesRequest.model_validate({"thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [
        {"role": "user", "content": "2 * 3?"}, {"role": "assistant", "content": message["content"]},
        {"role": "user", "content": "thanks"}]})
    assert messages_api.to_chat(request)["messages"][1] == {"role": "assistant", "content": "It is 6.",
                                                            "reasoning_content": "2 * 3 = 6"}


def test_blocks_a_text_model_cannot_take_are_refused() -> None:
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}
    with pytest.raises(UnsupportedContent) as refused:
        messages_api.to_chat(MessagesRequest.model_validate({"messages": [image]}))
    assert refused.value.fields["field"] == "messages.0.content.0"


@pytest.mark.parametrize(("finish", "calls", "reason"), [("stop", (), "end_turn"), ("length", (), "max_tokens"),
                                                         ("tool_calls", (CALL,), "tool_use")])
def test_a_chat_completion_is_answered_as_a_message(
    finish: str, calls: tuple[dict[str, Any], ...], reason: str
) -> None:
    body = messages_api.answer(chat_body("Computing.", calls, finish))
    assert body["stop_reason"] == reason and body["type"] == "message"
    assert body["content"][0] == {"type": "text", "text": "Computing."}
    if calls:
        assert body["content"][1] == {"type": "tool_use", "id": "call_1", "name": "calculator",
                                      "input": {"expression": "2 * 3"}}
    assert body["usage"] == {"input_tokens": 7, "output_tokens": 3} and body["rein"] == {"output_ids": [1, 2, 3]}


def test_a_message_streams_as_the_messages_events() -> None:
    events = sse(messages_api.events(chat_body("Computing.", (CALL,), "tool_calls")))
    assert [kind for kind, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Computing."}
    assert json.loads(events[5][1]["delta"]["partial_json"]) == {"expression": "2 * 3"}
    assert events[7][1]["delta"]["stop_reason"] == "tool_use"


# --------------------------------------------------------------------------- the echo, both wires

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_CALLS = st.lists(st.builds(
    lambda i, name, args: {"id": f"call_{i}", "type": "function",
                           "function": {"name": name, "arguments": json.dumps(args)}},
    st.integers(0, 10**6), st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
    st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), st.integers() | _TEXT, max_size=3),
), max_size=3, unique_by=lambda c: c["id"])


def _same_turn(echoed: dict[str, Any], chat: dict[str, Any]) -> None:
    """The echoed assistant message is the answer's: the same text and calls (arguments as JSON values)."""
    message = chat["choices"][0]["message"]
    assert (echoed["content"] or "") == (message["content"] or "")
    got = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in echoed.get("tool_calls", [])]
    want = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])]
    assert got == want


@given(_TEXT, _CALLS)
def test_an_answer_echoed_on_either_wire_is_the_assistant_message_it_answered(text: str, calls: Any) -> None:
    """What makes the next turn continue token-exact: a client that sends an answer back on the Responses or
    Messages wire gives the session machine the very assistant message the chat call answered."""
    chat = chat_body(text, tuple(calls), "tool_calls" if calls else "stop")
    response = responses_api.answer(chat, ResponsesRequest.model_validate({"input": "x"}))
    items = [{"role": "user", "content": "x"}, *response["output"]]
    [_, echoed] = responses_api.to_chat(ResponsesRequest.model_validate({"input": items}))["messages"]
    _same_turn(echoed, chat)
    message = messages_api.answer(chat)
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": message["content"]}]}
    [_, echoed] = messages_api.to_chat(MessagesRequest.model_validate(body))["messages"]
    _same_turn(echoed, chat)
