"""A scripted SGLang serving a two-turn calculator episode, and a proxy in front of it, for the tests of
third-party agents (``tests/integration/agents/``): the engine's ids are known, so a test can check that
every turn's recorded ids are exactly the engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.rollout.calculator import INSTRUCTION, evaluate
from shared.model.hf import HFFamily
from shared.model.hf_chat import HFChatTokenizer
from shared.schemas import Chunk
from tests.support.proxy import Proxy, ProxyFactory
from tests.support.sglang_engine import ScriptedServers, ScriptedSGLang

QUESTION = f"Compute 417 * 38. {INSTRUCTION}"
CALL_TEXT = ('Let me compute.\n<tool_call>[{"name": "calculator", "arguments": {"expression": "417 * 38"}}]'
             "</tool_call>")
ANSWER_TEXT = "417 * 38 = 15846.\nAnswer: 15846"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * / and parentheses."""
    return str(evaluate(expression))


class Scripted:
    """A scripted SGLang serving two turns (the call, then the answer) and a proxy in front of it."""

    def __init__(self, sglang: ScriptedServers, proxy_factory: ProxyFactory, model_dir: Path, **proxy: Any) -> None:
        tok = HFFamily(model_dir).tokenizer
        assert isinstance(tok, HFChatTokenizer)
        end = tok.inner.convert_tokens_to_ids("<|im_end|>")
        self.script = [[*tok.inner.encode(text, add_special_tokens=False), end] for text in (CALL_TEXT, ANSWER_TEXT)]
        self.engine: ScriptedSGLang
        self.engine, url = sglang(max_req_input_len=4000, token_delay_s=0.0, script=[list(s) for s in self.script])
        self.proxy: Proxy = proxy_factory([url], model=str(model_dir), **proxy)

    def open(self, group_id: str) -> dict[str, Any]:
        """``POST /v1/sessions``, as whoever runs a black-box agent does."""
        return self.proxy.open(group_id, prompt_id="p-417")

    def assert_token_exact(self) -> list[Chunk]:
        """Both turns recorded with exactly the engine's ids, the second continuing from the first's."""
        chunks = [r for r in self.proxy.records("chunks", 2) if isinstance(r, Chunk)]
        assert [c.output_ids for c in chunks] == self.script, "the engine's ids, verbatim"
        assert [c.segment_index for c in chunks] == [0, 0], "the second turn continues the segment"
        first, second = self.engine.generate_bodies[:2]
        assert second["input_ids"] == [*first["input_ids"], *self.script[0], *chunks[1].context_ids]
        return chunks


@pytest.fixture
def scripted(sglang: ScriptedServers, proxy_factory: ProxyFactory, tiny_llama_dir: Path) -> Scripted:
    return Scripted(sglang, proxy_factory, tiny_llama_dir)
