"""What an agent is answered for a reply, on SmolLM2's real tokenizer and template (``smollm2_dir``; only the
tokenizer is loaded): the session machine decodes the sampled ids and splits them by the family's conventions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.proxy.engine_client import EngineOutput
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import ChatOutcome, Session, ToolCalls
from shared.model.hf import HFChatTokenizer, HFFamily

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
