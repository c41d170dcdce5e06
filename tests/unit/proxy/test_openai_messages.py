"""OpenAI chat messages as the chat template takes them: text, tool calls, tool results, tools; a clear
400 for content a text model cannot take."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from services.proxy.openai_api import ChatRequest
from services.proxy.replies import ForceCall
from shared.errors import InvalidRequest, UnsupportedContent


def request(messages: list[dict[str, Any]], **extra: Any) -> ChatRequest:
    return ChatRequest.model_validate({"messages": messages, **extra})


def test_text_content_string_parts_and_none() -> None:
    body = request([
        {"role": "system", "content": "sé breve"},
        {"role": "user", "content": [{"type": "text", "text": "你好"}, {"type": "text", "text": "😀"}]},
        {"role": "assistant", "content": None},
    ])
    assert body.template_messages() == [
        {"role": "system", "content": "sé breve"},
        {"role": "user", "content": "你好\n😀"},
        {"role": "assistant", "content": ""},
    ]
    assert body.template_tools() is None


def test_tool_calls_tool_results_and_tools_pass_through() -> None:
    args = json.dumps({"a": 2, "b": 3})
    tool = {"type": "function", "function": {"name": "add", "description": "sum", "parameters": {"type": "object"}}}
    body = request([
        {"role": "user", "content": "2+3"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ], tools=[tool])
    messages = body.template_messages()
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": args}}
    assert messages[1]["tool_calls"] == [call]
    assert messages[2] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    assert body.template_tools() == [tool]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
])
def test_non_text_parts_are_a_clear_400(part: dict[str, Any]) -> None:
    body = request([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}])
    with pytest.raises(UnsupportedContent) as info:
        body.template_messages()
    assert info.value.status == 400 and info.value.code == "unsupported_content"
    assert info.value.detail()["field"] == "messages.0.content.1"
    assert part["type"] in info.value.message and "text model" in info.value.message


def test_text_part_without_text_is_invalid() -> None:
    with pytest.raises(InvalidRequest):
        request([{"role": "user", "content": [{"type": "text"}]}]).template_messages()


@pytest.mark.parametrize("bad", [
    {"messages": [{"role": "function", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
])
def test_what_the_schema_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ChatRequest.model_validate(bad)


def test_a_reply_with_tool_calls_has_openais_shape_whole_and_streamed() -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from services.proxy.openai_api import completion, sse_frames

    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": i})}}
             for i in range(2)]
    body = completion(model="m", content="", finish_reason="tool_calls", prompt_tokens=3, completion_tokens=9,
                      tool_calls=calls)
    parsed = ChatCompletion.model_validate(body)
    message = parsed.choices[0].message
    assert message.content is None and parsed.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        ("call_0", "add", '{"a": 0}'), ("call_1", "add", '{"a": 1}')]
    frames = [f.removeprefix("data: ").strip() for f in sse_frames(body)]
    assert frames[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(f) for f in frames[:-1]]
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert [(d[0].index, d[0].id, d[0].function and d[0].function.arguments) for d in deltas] == [
        (0, "call_0", '{"a": 0}'), (1, "call_1", '{"a": 1}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = ChatCompletion.model_validate(completion(model="m", content="hi", finish_reason="stop", prompt_tokens=1,
                                                     completion_tokens=1))
    assert plain.choices[0].message.content == "hi" and plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}}, ["tool_choice"]),
        ({"tool_choice": {"type": "custom", "custom": {"name": "f"}}}, ["tool_choice"]),
        ({"response_format": {"type": "json_object"}, "logit_bias": {"1": 5}}, ["response_format", "logit_bias"]),
        ({"presence_penalty": 0.5, "frequency_penalty": 0.1, "logprobs": True},
         ["presence_penalty", "frequency_penalty", "logprobs"]),
        ({"functions": [{"name": "f"}], "function_call": "auto"}, ["functions", "function_call"]),
    ],
)
def test_parameters_that_would_change_what_is_sampled_are_refused_by_name(
    extra: dict[str, Any], refused: list[str]
) -> None:
    from shared.errors import UnsupportedParameter

    with pytest.raises(UnsupportedParameter) as err:
        request([{"role": "user", "content": "hi"}], **extra).refuse_unsupported()
    assert [f["field"] for f in err.value.fields["fields"]] == refused
    assert err.value.status == 400


@pytest.mark.parametrize(
    ("extra", "calls"),
    [
        ({}, "all"),
        ({"tool_choice": "auto", "parallel_tool_calls": True, "response_format": {"type": "text"},
          "presence_penalty": 0, "logprobs": False}, "all"),
        ({"tool_choice": "none"}, "none"),
        ({"parallel_tool_calls": False}, "first"),
    ],
)
def test_what_is_honoured(extra: dict[str, Any], calls: str) -> None:
    body = request([{"role": "user", "content": "hi"}], **extra)
    body.refuse_unsupported()
    assert body.tool_calls() == calls


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("choice", "forced"), [
    ("auto", None), ("none", None), ("required", ForceCall()),
    ({"type": "function", "function": {"name": "f"}}, ForceCall("f")),
])
def test_required_and_a_named_function_force_a_call(choice: Any, forced: ForceCall | None) -> None:
    body = request([{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice=choice)
    body.refuse_unsupported()
    assert body.force_call() == forced


@pytest.mark.parametrize(("extra", "why"), [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]}, "not among the tools"),
])
def test_forcing_a_call_that_cannot_be_made_is_refused(extra: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidRequest, match=why) as err:
        request([{"role": "user", "content": "hi"}], **extra).force_call()
    assert err.value.fields["fields"][0]["field"] == "tool_choice"


def test_a_developer_message_is_a_system_message() -> None:
    """OpenAI's newer models take ``developer`` where older ones took ``system`` (422 before)."""
    body = request([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert body.template_messages()[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("harmless", [
    {"store": False}, {"metadata": {"k": "v"}}, {"user": "u-1"}, {"service_tier": "auto"},
    {"prompt_cache_key": "k"}, {"safety_identifier": "s"}, {"stream_options": {"include_usage": True}},
    {"modalities": ["text"]}, {"seed": None}, {"top_logprobs": 0},
])
def test_harmless_fields_are_accepted(harmless: dict[str, Any]) -> None:
    request([{"role": "user", "content": "hi"}], **harmless).refuse_unsupported()


@pytest.mark.parametrize(("extra", "refused"), [
    ({"seed": 7}, ["seed"]),  # changes sampling: never dropped silently
    ({"reasoning_effort": "low", "verbosity": "low"}, ["reasoning_effort", "verbosity"]),
    ({"modalities": ["text", "audio"], "audio": {"voice": "x"}}, ["modalities", "audio"]),
    ({"top_logprobs": 3}, ["top_logprobs"]),
    ({"chat_template_kwargs": {"enable_thinking": False}, "min_p": 0.1}, ["chat_template_kwargs", "min_p"]),
])
def test_fields_that_cannot_be_honoured_or_are_unknown_are_refused_by_name(extra: dict[str, Any],
                                                                           refused: list[str]) -> None:
    from shared.errors import UnsupportedParameter

    with pytest.raises(UnsupportedParameter) as err:
        request([{"role": "user", "content": "hi"}], **extra).refuse_unsupported()
    assert [f["field"] for f in err.value.fields["fields"]] == refused


def test_stop_is_a_string_or_up_to_four() -> None:
    assert request([{"role": "user", "content": "hi"}], stop="\n").stop_strings() == ("\n",)
    assert request([{"role": "user", "content": "hi"}], stop=["a", "b"]).stop_strings() == ("a", "b")
    for bad in (["a"] * 5, [""], ""):
        with pytest.raises(ValidationError):
            request([{"role": "user", "content": "hi"}], stop=bad)


def test_include_usage_streams_the_usage_in_a_chunk_of_its_own() -> None:
    """``stream_options.include_usage`` (smolagents' and many clients' streaming): a last chunk with no choices
    and the usage, as OpenAI's; the others carry none."""
    from openai.types.chat import ChatCompletionChunk

    from services.proxy.openai_api import completion, sse_frames

    body = completion(model="m", content="hi", finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    frames = [f.removeprefix("data: ").strip() for f in sse_frames(body, include_usage=True)]
    assert frames[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(f) for f in frames[:-1]]
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 4
