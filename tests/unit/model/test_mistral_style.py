"""Tool-call ids in the form a family's template takes back: Mistral's templates raise unless an id is 9
alphanumerics, so an agent echoing the ids the proxy gave would get 422 on its next call.

The fixture is SmolLM2's tokenizer with Mistral's markers added (not special, so an answer keeps them) and a
Mistral-style template written here: ``[INST]`` turns, calls as ``[TOOL_CALLS]`` and a JSON array carrying each
call's id, results as ``[TOOL_RESULTS]``, and the id check Mistral's own templates make.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.proxy.engine_client import EngineOutput
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import Session
from shared.model.base import UnrenderableMessages
from shared.model.hf_chat import HFChatTokenizer
from shared.model.tool_calls import ToolCallFormat, new_call_id
from tests.support.templates import with_template

ADDED = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]",
         "[/AVAILABLE_TOOLS]"]
TEMPLATE = """
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' -%}
{%- if message.tool_calls -%}
[TOOL_CALLS][
{%- for call in message.tool_calls -%}
{%- if call.id is not defined or call.id | length != 9 -%}
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif -%}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}
{%- if not loop.last %}, {% endif -%}
{%- endfor -%}
]{{ eos_token }}
{%- else -%}
{{ message.content }}{{ eos_token }}
{%- endif -%}
{%- elif message.role == 'tool' -%}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 -%}
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif -%}
[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif -%}
{%- endfor -%}
"""
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def mistral_style(smollm2_dir: Path) -> HFChatTokenizer:
    tok = with_template(smollm2_dir, ADDED, TEMPLATE)
    assert tok.tool_call_format is ToolCallFormat.MISTRAL
    return tok


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    ids = {new_call_id(ToolCallFormat.MISTRAL) for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", new_call_id(ToolCallFormat.HERMES))


def test_the_ids_the_proxy_answers_are_ids_the_template_takes_back(mistral_style: HFChatTokenizer) -> None:
    question = {"role": "user", "content": "add 2 and 3"}
    session = Session("s", "g", tokenizer=mistral_style, tool_calls=mistral_style.tool_call_format)
    plan = session.begin([question], "t1", tools=TOOLS)
    end = mistral_style.inner.convert_tokens_to_ids("<|im_end|>")
    sampled = [*mistral_style.inner.encode('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]',
                                           add_special_tokens=False), end]
    out = EngineOutput("r0", sampled, [-0.1] * len(sampled), "v1", ["v1"] * len(sampled), "stop")
    session.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
    session.chunk_sent()
    answer = session.complete(Generation(output_ids=sampled, finish_reason="stop", chunks=[]))
    [call] = answer.tool_calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]), call["id"]
    history = [question, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    session.begin(history, "t2", tools=TOOLS)  # an id of another form: 422, the template refuses it
    with pytest.raises(UnrenderableMessages, match="length 9"):
        mistral_style.encode_chat([question, {"role": "assistant", "content": None, "tool_calls": [
            {**call, "id": "call_" + "x" * 24}]}], add_generation_prompt=True, tools=TOOLS)
