"""Tool calls in a continued conversation on SmolLM2's tokenizer (the ``hf`` fixture): tools rendered in
the model's trained form though its template ignores them, an assistant's tool calls folded into its
content, and a sampled call answered as OpenAI tool calls whose echo, reformatted by the agent or shaped
by ``tool_choice``, still continues from the ids sampled, not from a rendering of the calls."""

from __future__ import annotations

import json

import pytest

from services.proxy.engine_client import EngineOutput
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import Session
from shared.model.base import Turn
from shared.model.hf_chat import HFChatTokenizer
from shared.model.tool_calls import ToolCallFormat
from tests.support.chat_turns import grow, ids_of, im_end, user


def test_tool_call_shaped_messages(hf: HFChatTokenizer) -> None:
    """SmolLM2's template knows no tools: an assistant's tool_calls are folded into its content as
    <tool_call> JSON (arguments parsed from OpenAI's string), so a model that sampled that text
    continues into the tool result without a new segment."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    turns: list[Turn] = []
    grow(hf, turns, [user("2+3 with the tool")], [*ids_of(hf, reply), im_end(hf)], tools=tools)
    messages = [user("2+3 with the tool"), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5 ✓"}]
    delta = hf.continue_chat(turns, messages, tools=tools)
    assert delta is not None
    assert hf._text(delta) == "\n<|im_start|>tool\n5 ✓<|im_end|>\n<|im_start|>assistant\n"


def test_tools_open_the_system_message_when_the_template_ignores_them(hf: HFChatTokenizer) -> None:
    """SmolLM2's ChatML drops ``tools``: they are rendered in its trained form instead, before the
    agent's own system text, and never without tools."""
    assert not hf.template_knows_tools
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b <|im_end|>",
                                               "parameters": {"type": "object"}}}]
    plain = hf.render_chat([user("hi")], add_generation_prompt=True)
    assert "<tools>" not in plain
    alone = hf.render_chat([user("hi")], add_generation_prompt=True, tools=tools)
    assert alone.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert '<tools>[{"type": "function", "function": {"name": "add"' in alone and "<tool_call>[" in alone
    merged = hf.render_chat([{"role": "system", "content": "Be brief."}, user("hi")], add_generation_prompt=True,
                            tools=tools)
    assert merged.count("<|im_start|>system") == 1 and "</tool_call>\n\nBe brief.<|im_end|>" in merged
    ids = hf.encode_chat([user("hi")], add_generation_prompt=True, tools=tools)
    assert ids.count(im_end(hf)) == 2, "the description's <|im_end|> is text, not a turn's end"


def test_a_tool_call_answered_parsed_and_echoed_reformatted_continues_token_exact(hf: HFChatTokenizer) -> None:
    """The session answers the sampled call text as content + OpenAI tool_calls (SmolLM2: hermes, by
    auto-detection), two calls in parallel; the agent sends them back with its own JSON spacing and
    ids, and the tool results: the segment goes on from the ids sampled, not a rendering of the calls."""
    assert hf.tool_call_format is ToolCallFormat.HERMES
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = ('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>{"name":"add","arguments":{"a":1,"b":1}}</tool_call>')
    sampled = [*ids_of(hf, text), im_end(hf)]
    session = Session("s", "g", tokenizer=hf, tool_calls=hf.tool_call_format)
    plan = session.begin([user("2+3 and 1+1")], "t1", tools=tools)
    out = EngineOutput("r0", sampled, [-0.1] * len(sampled), "v1", ["v1"] * len(sampled), "stop")
    session.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
    session.chunk_sent()
    answer = session.complete(Generation(output_ids=sampled, finish_reason="stop", chunks=[]))
    assert answer.finish_reason == "tool_calls" and answer.content == "I will add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls] == [
        ("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})]
    echoed = {"role": "assistant", "content": "I will add.", "tool_calls": [
        {"id": f"x{i}", "type": "function",
         "function": {"name": c["function"]["name"], "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                                            separators=(",", ":"))}}
        for i, c in enumerate(answer.tool_calls)]}
    history = [user("2+3 and 1+1"), echoed, {"role": "tool", "tool_call_id": "x0", "content": "5"},
               {"role": "tool", "tool_call_id": "x1", "content": "2"}]
    second = session.begin(history, "t2", tools=tools)
    assert not second.new_segment
    assert second.prompt_ids[: len(plan.context_ids) + len(sampled)] == (*plan.context_ids, *sampled)
    assert hf._text(second.context_ids).startswith("\n<|im_start|>tool\n5<|im_end|>")
    session.cancel()
    edited = {**echoed, "tool_calls": echoed["tool_calls"][:1]}  # a call dropped: not this answer any more
    assert session.begin([user("2+3 and 1+1"), edited, history[2]], "t3", tools=tools).new_segment


@pytest.mark.parametrize(("calls", "expected"), [("none", 0), ("first", 1), ("all", 2)])
def test_tool_choice_none_and_no_parallel_calls_shape_the_answer_not_the_ids(
    hf: HFChatTokenizer, calls: str, expected: int
) -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    sampled = [*ids_of(hf, text), im_end(hf)]
    session = Session("s", "g", tokenizer=hf, tool_calls=hf.tool_call_format)
    plan = session.begin([user("go")], "t1")
    out = EngineOutput("r0", sampled, [-0.1] * len(sampled), "v1", ["v1"] * len(sampled), "stop")
    session.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
    session.chunk_sent()
    answer = session.complete(Generation(output_ids=sampled, finish_reason="stop", chunks=[]),
                              calls=calls)  # type: ignore[arg-type]
    assert len(answer.tool_calls) == expected and answer.rein["output_ids"] == sampled
    assert answer.content == (text if calls == "none" else "")
    echoed = {"role": "assistant", "content": answer.content or None,
              **({"tool_calls": list(answer.tool_calls)} if answer.tool_calls else {})}
    history = [user("go"), echoed, *({"role": "tool", "tool_call_id": c["id"], "content": "ok"}
                                     for c in answer.tool_calls), user("next")]
    assert not session.begin(history, "t2").new_segment, "the echo stands for every id sampled"
