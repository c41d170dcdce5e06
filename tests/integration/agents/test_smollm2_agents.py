"""The same three third-party agents against the real SmolLM2-135M-Instruct (rein's engine, CPU): each
completes at least a turn through the proxy, offered the calculator tool, and what the model sampled
is recorded for the agent's session. Whether the 135M model writes a well-formed call is its own
business (docs/agents.md has the share it reaches while training); a malformed call comes back as
content, never as an error, so every agent gets an answer it can act on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.rollout.calculator import INSTRUCTION, TOOLS, evaluate
from shared.schemas import Chunk
from tests.support.proxy import Proxy, ProxyFactory, proxy_factory
from tests.support.stack import Engine, temp_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
__all__ = ["proxy_factory"]

QUESTION = f"Compute 417 * 38. {INSTRUCTION}"
MAX_TOKENS = 48


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * / and parentheses."""
    try:
        return str(evaluate(expression))
    except ValueError as exc:
        return f"error: {exc}"


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with temp_engine(tmp_path_factory, extra_env={"REIN_MODEL": str(smollm2_dir)}) as engine:
        yield engine


@pytest.fixture
def proxy(smollm2_engine: Engine, proxy_factory: ProxyFactory, smollm2_dir: Path) -> Proxy:
    return proxy_factory([smollm2_engine.url], model=str(smollm2_dir))


def opened(proxy: Proxy) -> dict[str, str]:
    return {k: str(v) for k, v in proxy.open(f"g-{uuid.uuid4().hex}").items()}


def recorded(proxy: Proxy, session_id: str) -> list[Chunk]:
    """The session's chunks: at least one, each with the tokens the model sampled."""
    chunks = [r for r in proxy.records("chunks", 1) if isinstance(r, Chunk)]
    assert chunks and {c.session_id for c in chunks} == {session_id}
    assert all(0 < len(c.output_ids) <= MAX_TOKENS for c in chunks)
    return chunks


def test_the_agents_sdk_completes_a_turn(proxy: Proxy) -> None:
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
    )

    session = opened(proxy)

    async def run() -> int:
        async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=session["api_key"], max_retries=0) as client:
            agent = Agent(name="calculator agent", tools=[function_tool(calculator)],
                          model=OpenAIChatCompletionsModel(model="m", openai_client=client),
                          model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0.0))
            try:
                result = await Runner.run(agent, QUESTION, run_config=RunConfig(tracing_disabled=True), max_turns=1)
            except MaxTurnsExceeded:  # the model called the tool: the one turn allowed is complete
                return 1
            return len(result.raw_responses)

    assert asyncio.run(run()) == 1
    recorded(proxy, session["session_id"])


def test_langchain_completes_a_turn(proxy: Proxy) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    session = opened(proxy)
    model = ChatOpenAI(model="m", base_url=session["base_url"], api_key="unused", max_retries=0,  # type: ignore[call-arg]
                       max_tokens=MAX_TOKENS, temperature=0.0)
    reply = model.bind_tools([tool(calculator)]).invoke(QUESTION)
    assert reply.content or reply.tool_calls  # type: ignore[attr-defined]
    recorded(proxy, session["session_id"])


def test_the_llm_cli_completes_a_turn(proxy: Proxy, tmp_path: Path) -> None:
    session = opened(proxy)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LLM_"))}
    env["LLM_USER_PATH"] = str(tmp_path / "llm")
    tool = TOOLS[0]["function"]
    assert tool["name"] == calculator.__name__
    proc = subprocess.run(
        [sys.executable, "-m", "llm", "openai", "endpoint", f"{proxy.url}/v1", QUESTION, "-m", "m",
         "--key", session["api_key"], "-o", "max_tokens", str(MAX_TOKENS), "-o", "temperature", "0",
         "--functions", "from services.rollout.calculator import evaluate\n"
                        "def calculator(expression: str) -> str:\n"
                        f'    """{tool["description"]}"""\n'
                        "    return str(evaluate(expression))\n",
         "--chain-limit", "2"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    # llm counts replies against its chain limit: a first reply with a call runs the tool and gets a second
    # reply, which reaches the limit of two (llm says so and exits 1); a first reply without one ends the run
    ended = proc.returncode == 0 or (proc.returncode == 1 and "Chain limit of 2 exceeded" in proc.stderr)
    assert ended, f"llm exited {proc.returncode}: {proc.stderr[-2000:]}"
    recorded(proxy, session["session_id"])
