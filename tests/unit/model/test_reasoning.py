"""A reasoning model's thinking (``<think>…</think>``) answered apart from its content, per the family's template,
and echoed back token-exact: on a Qwen3-style template fixture (``tests/support/templates.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.proxy.engine_client import EngineOutput
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.openai_api import completion, sse_frames
from services.proxy.replies import ChatOutcome
from services.proxy.session_machine import Session
from shared.model.hf_chat import HFChatTokenizer
from shared.model.reasoning import THINK, detect_reasoning
from shared.model.tool_calls import ToolCallFormat
from tests.support.templates import QWEN3_TEMPLATE, qwen3_style

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
QUESTION = {"role": "user", "content": "add 2 and 3"}


@pytest.fixture(scope="module")
def qwen3(smollm2_dir: Path) -> HFChatTokenizer:
    tok = qwen3_style(smollm2_dir)
    assert tok.reasoning is THINK and tok.tool_call_format is ToolCallFormat.HERMES
    return tok


@pytest.mark.parametrize(("text", "thinking", "answer"), [
    ("<think>\nadd them\n</think>\n\n5", "\nadd them\n", "\n\n5"),  # Qwen3: the model opens it
    ("add them\n</think>\n\n5", "add them\n", "\n\n5"),  # DeepSeek-R1: the generation prompt opened it
    ("<think>\nstill thinking when the budget ran out", "\nstill thinking when the budget ran out", ""),
    ("5", None, "5"),
])
def test_thinking_is_split_off_the_reply(text: str, thinking: str | None, answer: str) -> None:
    assert THINK.split(text) == (thinking, answer)


def test_the_convention_is_read_from_the_template() -> None:
    assert detect_reasoning(QWEN3_TEMPLATE) is THINK and detect_reasoning("{{ messages }}") is None


def _turn(tok: HFChatTokenizer, session: Session, messages: list[dict[str, Any]], text: str) -> ChatOutcome:
    sampled = [*tok.inner.encode(text, add_special_tokens=False), tok.inner.convert_tokens_to_ids("<|im_end|>")]
    plan = session.begin(messages, "t", tools=TOOLS)
    out = EngineOutput("r", sampled, [-0.1] * len(sampled), "v1", ["v1"] * len(sampled), "stop")
    session.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
    session.chunk_sent()
    return session.complete(Generation(output_ids=sampled, finish_reason="stop", chunks=[]))


def test_thinking_is_answered_as_reasoning_content_and_streamed(qwen3: HFChatTokenizer) -> None:
    session = Session("s", "g", tokenizer=qwen3, tool_calls=qwen3.tool_call_format)
    answer = _turn(qwen3, session, [QUESTION], "<think>\n2 plus 3 is 5.\n</think>\n\nIt is 5.")
    assert (answer.reasoning, answer.content, answer.finish_reason) == ("2 plus 3 is 5.", "It is 5.", "stop")
    body = completion(model="m", content=answer.content, finish_reason="stop", prompt_tokens=1, completion_tokens=1,
                      reasoning=answer.reasoning)
    assert body["choices"][0]["message"]["reasoning_content"] == "2 plus 3 is 5."
    deltas = [json.loads(f.removeprefix("data: "))["choices"][0]["delta"] for f in sse_frames(body)
              if f.startswith("data: {")]
    assert {"reasoning_content": "2 plus 3 is 5."} in deltas and {"content": "It is 5."} in deltas


@pytest.mark.parametrize("send_back_thinking", [False, True], ids=["thinking-dropped", "thinking-sent-back"])
def test_a_tool_turn_with_thinking_echoed_back_continues_token_exact(qwen3: HFChatTokenizer,
                                                                     send_back_thinking: bool) -> None:
    """Thinking, then a call; the agent sends the call back (with its thinking or, as most clients, without)
    and the tool's result: the segment goes on from the sampled ids, the template renders the same text."""
    session = Session("s", "g", tokenizer=qwen3, tool_calls=qwen3.tool_call_format)
    text = ('<think>\nI need the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
            "</tool_call>")
    answer = _turn(qwen3, session, [QUESTION], text)
    assert answer.reasoning == "I need the tool." and answer.content == "" and len(answer.tool_calls) == 1
    echoed: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": list(answer.tool_calls)}
    if send_back_thinking:
        echoed["reasoning_content"] = answer.reasoning
    history = [QUESTION, echoed, {"role": "tool", "tool_call_id": answer.tool_calls[0]["id"], "content": "5"}]
    seg = session.current
    assert seg is not None
    before = list(seg.token_ids)
    second = session.begin(history, "t2", tools=TOOLS)
    assert not second.new_segment and list(second.prompt_ids[:len(before)]) == before
    as_sampled = [QUESTION, {**echoed, "reasoning_content": answer.reasoning}, history[2]]  # the echo stands for it
    assert qwen3._text(second.prompt_ids) == qwen3.render_chat(as_sampled, add_generation_prompt=True, tools=TOOLS)


def test_thinking_sent_back_edited_starts_a_new_segment(qwen3: HFChatTokenizer) -> None:
    session = Session("s", "g", tokenizer=qwen3, tool_calls=qwen3.tool_call_format)
    answer = _turn(qwen3, session, [QUESTION], "<think>\nhm\n</think>\n\nIt is 5.")
    edited = {"role": "assistant", "content": answer.content, "reasoning_content": "something else"}
    plan = session.begin([QUESTION, edited, {"role": "tool", "tool_call_id": "x", "content": "ok"}], "t2",
                         tools=TOOLS)
    assert plan.new_segment and plan.reason == "assistant_edited"
