"""OpenAI chat messages as the chat template takes them: text, tool calls, tool results, tools; a clear
400 for content a text model cannot take."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from services.proxy.openai_api import ChatRequest
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
    {"messages": [{"role": "developer", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
])
def test_what_the_schema_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ChatRequest.model_validate(bad)
