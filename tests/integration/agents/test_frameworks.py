"""Third-party agents through the proxy, unchanged, on a scripted engine (exact ids): the OpenAI Agents SDK
with a function tool, LangChain's ``ChatOpenAI.bind_tools``, and Simon Willison's ``llm`` CLI run as a
black box that is given only a base URL and a key. Each completes a tool round trip (the model's call
text comes back as ``tool_calls``, the agent runs the tool and sends its own serialization of the call
back with the result), and the session's recorded ids are exactly the engine's on every turn: the
second turn continues from the sampled ids, never a re-tokenization of the answer.

The black-box run is the whole path a CLI agent takes (docs/agents.md): whoever runs it opens a
session (``POST /v1/sessions``) and dispatches its group, the CLI calls the proxy with the key as its
API key, the runner posts the reward by the key, and a real collector assembles the group.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from services.collector.settings import CollectorSettings
from services.rollout.calculator import evaluate
from shared.model.hf import HFFamily
from shared.model.hf_chat import HFChatTokenizer
from shared.schemas import Chunk, CompletedGroup, GroupDispatched
from tests.support.collector import Running, Source, Tail, make_settings
from tests.support.proxy import ProxyFactory, proxy_factory
from tests.support.scripted_agent import ANSWER_TEXT, QUESTION, Scripted, calculator, scripted
from tests.support.sglang_engine import ScriptedServers, sglang

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory", "scripted", "sglang"]


@pytest.mark.parametrize("wire", ["chat_completions", "responses"])
def test_the_openai_agents_sdk_runs_a_function_tool_token_exact(scripted: Scripted, wire: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        RunResult,
        function_tool,
    )

    opened = scripted.open(f"g-{uuid.uuid4().hex}")

    async def run() -> RunResult:
        async with openai.AsyncOpenAI(base_url=f"{scripted.proxy.url}/v1", api_key=opened["api_key"],
                                      max_retries=0) as client:
            agent = Agent(
                name="calculator agent", instructions="You are a careful assistant.",
                tools=[function_tool(calculator)], model_settings=ModelSettings(max_tokens=200, store=False),
                model=OpenAIResponsesModel(model="m", openai_client=client) if wire == "responses"  # the SDK's default
                else OpenAIChatCompletionsModel(model="m", openai_client=client),
            )
            return await Runner.run(agent, QUESTION, run_config=RunConfig(tracing_disabled=True), max_turns=4)

    result = asyncio.run(run())
    assert result.final_output == ANSWER_TEXT
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == ["15846"], "the SDK ran the call the proxy parsed"
    chunks = scripted.assert_token_exact()
    assert {c.session_id for c in chunks} == {opened["session_id"]}, "the API key named the session"


def test_langchain_bind_tools_round_trips_token_exact(scripted: Scripted) -> None:
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    opened = scripted.open(f"g-{uuid.uuid4().hex}")
    model = ChatOpenAI(model="m", base_url=opened["base_url"], api_key="unused", max_retries=0, max_tokens=200)  # type: ignore[call-arg]
    calc = tool(calculator)
    bound = model.bind_tools([calc])
    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    first = bound.invoke(messages)
    assert first.content == "Let me compute."
    [call] = first.tool_calls  # type: ignore[attr-defined]
    assert (call["name"], call["args"]) == ("calculator", {"expression": "417 * 38"})
    messages += [first, ToolMessage(content=calc.invoke(call["args"]), tool_call_id=call["id"])]
    second = bound.invoke(messages)
    assert second.content == ANSWER_TEXT and not second.tool_calls  # type: ignore[attr-defined]
    chunks = scripted.assert_token_exact()
    assert {c.session_id for c in chunks} == {opened["session_id"]}, "the session's base URL named the session"


def test_smolagents_tool_calling_agent_sends_required_and_gets_a_forced_call(
    sglang: ScriptedServers, proxy_factory: ProxyFactory, tiny_llama_dir: Path,
) -> None:
    """smolagents' ``ToolCallingAgent`` sends ``tool_choice: "required"`` on every call (its
    ``ApiModel._prepare_completion_kwargs`` default) and ends only through its ``final_answer`` tool. The
    proxy serves it: the family's opener (``<tool_call>`` for SmolLM2) follows the generation prompt as
    context the engine did not sample, and the sampled rest is each call."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    tok = HFFamily(tiny_llama_dir).tokenizer
    assert isinstance(tok, HFChatTokenizer)
    end = tok.inner.convert_tokens_to_ids("<|im_end|>")
    replies = ['[\n{"name": "calculator", "arguments": {"expression": "417 * 38"}}\n]</tool_call>',
               '[\n{"name": "final_answer", "arguments": {"answer": "15846"}}\n]</tool_call>']
    script = [[*tok.inner.encode(text, add_special_tokens=False), end] for text in replies]
    engine, url = sglang(max_req_input_len=4000, token_delay_s=0.0, script=[list(s) for s in script])
    proxy = proxy_factory([url], model=str(tiny_llama_dir))
    opened = proxy.open(f"g-{uuid.uuid4().hex}", prompt_id="p-417")

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression of integers with + - * / and parentheses.

        Args:
            expression: the expression, e.g. "2 * 3".
        """
        return str(evaluate(expression))

    model = OpenAIServerModel(model_id="m", api_base=opened["base_url"], api_key="unused",
                              client_kwargs={"max_retries": 0, "timeout": 60})
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=-1)
    assert str(agent.run(QUESTION)) == "15846"
    opener = tok.call_opener(tok.tool_call_format)
    assert opener is not None and tok._text(opener) == "<tool_call>"
    assert len(engine.generate_bodies) == 2
    assert all(body["input_ids"][-len(opener):] == opener for body in engine.generate_bodies), "forced, every call"
    chunks = [r for r in proxy.records("chunks", 2) if isinstance(r, Chunk)]
    assert [c.output_ids for c in chunks] == script, "the engine's ids, verbatim: only these are trained"
    assert [c.forced_ids for c in chunks] == [opener, opener], "the record says what was forced"
    # smolagents sends its calls back as text ("Calling tools:\n[...]") and the results as user turns: an edited
    # history, so each call starts a segment of its own (docs/agents.md)
    assert [c.segment_index for c in chunks] == [0, 1]


@pytest.fixture
def collector_settings(kafka_bootstrap: str, redis_db_url: str) -> CollectorSettings:
    return make_settings(kafka_bootstrap, redis_db_url, batch_groups=1)


@pytest.fixture
def assembled(collector_settings: CollectorSettings) -> Iterator[Callable[[str], CompletedGroup]]:
    """A real collector on the settings' topics; the callable waits for a group's audit record."""
    with Running(collector_settings):
        tail = Tail(collector_settings, collector_settings.topics.groups)
        try:
            def wait(group_id: str) -> CompletedGroup:
                records = tail.wait(lambda rs: any(isinstance(r, CompletedGroup) and r.group_id == group_id
                                                   for r in rs), f"group {group_id} assembled")
                return next(r for r in records if isinstance(r, CompletedGroup) and r.group_id == group_id)

            yield wait
        finally:
            tail.close()


def test_a_black_box_cli_given_only_a_base_url_and_a_key_trains_through_rein(
    sglang: ScriptedServers, proxy_factory: ProxyFactory, tiny_llama_dir: Path,
    collector_settings: CollectorSettings, assembled: Callable[[str], CompletedGroup], tmp_path: Path,
) -> None:
    scripted = Scripted(sglang, proxy_factory, tiny_llama_dir, topics=collector_settings.topics)
    group_id = f"g-{uuid.uuid4().hex}"
    opened = scripted.open(group_id)
    source = Source(collector_settings)  # the rollout runner's part: the group and who is in it
    try:
        source.records([GroupDispatched(group_id=group_id, prompt_id="p-417", session_ids=[opened["session_id"]])])
    finally:
        source.close()

    # `llm openai endpoint URL PROMPT`: an OpenAI-compatible endpoint, a key, a Python function as the tool;
    # llm's own tool loop, streaming (its default). Nothing rein-specific but the two values.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LLM_"))}
    env["LLM_USER_PATH"] = str(tmp_path / "llm")
    proc = subprocess.run(
        [sys.executable, "-m", "llm", "openai", "endpoint", f"{scripted.proxy.url}/v1", QUESTION, "-m", "m",
         "--key", opened["api_key"], "--functions", _source_of_calculator(), "--chain-limit", "3"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, f"llm exited {proc.returncode}: {proc.stderr[-2000:]}"
    assert "Answer: 15846" in proc.stdout

    finished = scripted.proxy.runner.post(f"/v1/sessions/{opened['api_key']}/finish", json={"reward": 1.0})
    assert finished.status_code == 200, finished.text
    group = assembled(group_id)
    [trajectory] = group.trajectories
    assert (trajectory.session_id, trajectory.status, trajectory.reward) == (opened["session_id"], "completed", 1.0)
    [segment] = trajectory.segments
    trained = [t for t, m in zip(segment.token_ids, segment.loss_mask, strict=True) if m]
    assert trained == [*scripted.script[0], *scripted.script[1]], "exactly the sampled ids are trained"
    scripted.assert_token_exact()


def _source_of_calculator() -> str:
    """The tool as ``llm --functions`` takes it: Python source defining the function (rein's evaluator)."""
    return (
        "def calculator(expression: str) -> str:\n"
        '    """Evaluate an arithmetic expression of integers with + - * / and parentheses."""\n'
        "    from services.rollout.calculator import evaluate\n"
        "    return str(evaluate(expression))\n"
    )
