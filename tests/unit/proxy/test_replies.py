"""What an agent is answered for a reply, on SmolLM2's real tokenizer and template (``smollm2_dir``; only the
tokenizer is loaded): the session machine decodes the sampled ids and splits them by the family's conventions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.proxy.engine_client import EngineOutput
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.replies import ChatOutcome, ForceCall, ToolCalls
from services.proxy.session_machine import Session
from shared.errors import UnsupportedParameter
from shared.model.hf import HFFamily
from shared.model.hf_chat import HFChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
QUESTION = {"role": "user", "content": "add 2 and 3"}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> HFChatTokenizer:
    tokenizer = HFFamily(smollm2_dir).tokenizer
    assert isinstance(tokenizer, HFChatTokenizer)
    return tokenizer


def end_id(tok: HFChatTokenizer) -> int:
    found = tok.inner.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(found, int)
    return found


def answered(tok: HFChatTokenizer, text: str, messages: list[dict[str, Any]] | None = None,
             calls: ToolCalls = "all", **begin: Any) -> tuple[Session, ChatOutcome]:
    """A session whose first call sampled ``text`` and stopped."""
    sampled = [*tok.inner.encode(text, add_special_tokens=False), end_id(tok)]
    session = Session("s", "g", tokenizer=tok, tool_calls=tok.tool_call_format)
    plan = session.begin(messages or [QUESTION], "t1", tools=TOOLS, **begin)
    out = EngineOutput("r0", sampled, [-0.1] * len(sampled), "v1", ["v1"] * len(sampled), "stop")
    session.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
    session.chunk_sent()
    return session, session.complete(Generation(output_ids=sampled, finish_reason="stop", chunks=[]), calls=calls)


def test_smollm2s_empty_call_list_is_an_answer_without_calls(smollm2: HFChatTokenizer) -> None:
    """SmolLM2's tools prompt asks for ``<tool_call>[]</tool_call>`` when no call is needed: that is the model
    saying it calls nothing, answered as the text around it, not a malformed call returned raw."""
    session, answer = answered(smollm2, "2 + 3 is 5.\n<tool_call>[]</tool_call>")
    assert (answer.content, answer.tool_calls, answer.finish_reason) == ("2 + 3 is 5.", (), "stop")
    assert answer.call_markup == "empty", "counted as the model's own 'no call', not as malformed"
    echoed = [QUESTION, {"role": "assistant", "content": answer.content}, {"role": "user", "content": "thanks"}]
    assert not session.begin(echoed, "t2", tools=TOOLS).new_segment, "echoed back, it stands for the sampled ids"


def test_a_forced_call_opener_is_context_and_the_reply_a_call(smollm2: HFChatTokenizer) -> None:
    """``tool_choice: required`` / a named function: the family's opener follows the generation prompt as ids the
    engine did not sample; the sampled rest completes the call, which is answered as ``tool_calls``; echoed back
    it continues the segment (the opener reads as the start of the assistant's text)."""
    opener = smollm2.call_opener(smollm2.tool_call_format, "add")
    assert opener is not None and smollm2._text(opener) == '<tool_call>[\n{"name": "add", "arguments": '
    session, answer = answered(smollm2, '{"a": 2, "b": 3}}\n]</tool_call>', force=ForceCall("add"))
    seg = session.current
    assert seg is not None
    [(context, sampled)] = seg.turns
    assert answer.rein["forced_ids"] == opener and seg.token_ids[len(context):len(context) + len(opener)] == opener
    assert seg.versions[len(context):len(context) + len(opener)] == [None] * len(opener), "context: never trained"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in answer.tool_calls] == [
        ("add", '{"a": 2, "b": 3}')]
    assert answer.finish_reason == "tool_calls" and answer.completion_tokens == len(sampled) - len(opener)
    echoed = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": c["function"]} for c in answer.tool_calls]},
        {"role": "tool", "tool_call_id": "x", "content": "5"}]
    second = session.begin(echoed, "t2", tools=TOOLS)
    assert not second.new_segment and second.prompt_ids[:len(seg.token_ids)] == tuple(seg.token_ids)


def test_a_forced_call_that_does_not_parse_is_content(smollm2: HFChatTokenizer) -> None:
    _, answer = answered(smollm2, "I would rather not.", force=ForceCall())
    assert answer.tool_calls == () and answer.content == "<tool_call>I would rather not."
    assert answer.call_markup == "malformed"


def test_a_family_without_a_call_convention_refuses_to_force_one() -> None:
    session = Session("s", "g")  # the tiny policy writes no calls
    with pytest.raises(UnsupportedParameter):
        session.begin([QUESTION], "t1", force=ForceCall())
    assert session.phase == "open"
