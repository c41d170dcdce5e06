"""The rollout runner's black-box agent (``REIN_AGENT_COMMAND``): a real CLI from PyPI (``llm``), given only
the session's base URL and key, plays a calculator episode through a real proxy on a scripted engine; its
stdout is graded and the reward posted by the session. A command that fails or hangs ends its episode as
failed, and the agent never sees the runner's ``REIN_*`` settings."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
import openai
import pytest

from services.rollout.agent import EpisodeResult, ProxyClients, SessionIds
from services.rollout.calculator import CalculatorEpisode
from services.rollout.command_agent import CommandAgent
from shared.lender import Lender
from shared.schemas import SessionFinished
from tests.support.proxy import proxy_factory
from tests.support.scripted_agent import ANSWER_TEXT, Scripted, scripted
from tests.support.sglang_engine import sglang

pytestmark = [pytest.mark.integration]
__all__ = ["proxy_factory", "scripted", "sglang"]

PAYLOAD = {"a": 417, "op": "*", "b": 38}
CALCULATOR = ("def calculator(expression: str) -> str:\n"
              '    """Evaluate an arithmetic expression of integers with + - * / and parentheses."""\n'
              "    from services.rollout.calculator import evaluate\n"
              "    return str(evaluate(expression))\n")


def play(proxy_url: str, command: Sequence[str], timeout_s: float = 120) -> EpisodeResult:
    """One calculator episode through ``CommandAgent`` (the runner's clients, one session)."""
    episode = CalculatorEpisode()

    async def run() -> EpisodeResult:
        async with openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0) as chat, \
                httpx.AsyncClient(timeout=30) as http:
            agent = CommandAgent(Lender(lambda: ProxyClients(chat, http)), command=command, timeout_s=timeout_s,
                                 proxy_url=proxy_url, model="m", max_tokens=200, temperature=1.0)
            ids = SessionIds(f"s-{uuid.uuid4().hex}", f"g-{uuid.uuid4().hex}", "p-417", 0)
            return await agent.run(episode, dict(PAYLOAD), ids)

    return asyncio.run(run())


def test_a_cli_agent_plays_an_episode_graded_by_the_task(scripted: Scripted, tmp_path: Path) -> None:
    command = ["env", f"LLM_USER_PATH={tmp_path}", sys.executable, "-m", "llm", "openai", "endpoint", "{base_url}",
               "{prompt}", "-m", "m", "--key", "{api_key}", "--functions", CALCULATOR, "--chain-limit", "3"]
    result = play(scripted.proxy.url, command)
    assert (result.outcome, result.reward, result.reported, result.on_record) == ("completed", 1.0, True, True)
    assert result.messages[-1]["content"].endswith(ANSWER_TEXT)
    records = scripted.proxy.records("events", 1)
    [finished] = [r for r in records if isinstance(r, SessionFinished)]
    assert (finished.session_id, finished.reward, finished.num_chunks) == (result.session_id, 1.0, 2)
    chunks = scripted.assert_token_exact()
    assert {c.session_id for c in chunks} == {result.session_id}


def test_a_failing_command_fails_its_episode(scripted: Scripted) -> None:
    result = play(scripted.proxy.url, ["sh", "-c", "echo 'Answer: 15846'; exit 3"])
    assert (result.outcome, result.error, result.reward) == ("failed", "agent_exit_3", 0.0)
    assert result.on_record, "finished by its key: on record though the agent made no call"
    [end] = [r for r in scripted.proxy.records("events", 1) if isinstance(r, SessionFinished)]
    assert (end.session_id, end.status, end.error, end.num_chunks) == (result.session_id, "failed", "agent_exit_3", 0)


def test_a_command_that_cannot_start_fails_its_episode(scripted: Scripted) -> None:
    result = play(scripted.proxy.url, ["/nonexistent/agent", "{prompt}"])
    assert (result.outcome, result.error) == ("failed", "agent_not_started")


def test_a_command_past_its_timeout_is_killed(scripted: Scripted) -> None:
    started = time.monotonic()
    result = play(scripted.proxy.url, ["sh", "-c", "sleep 60 & sleep 60; wait"], timeout_s=0.5)
    assert (result.outcome, result.error) == ("failed", "agent_timeout")
    assert time.monotonic() - started < 20, "the process group was killed, not waited for"


def test_the_command_gets_the_session_and_no_rein_settings(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REIN_ADMIN_TOKEN", "secret-of-the-runner")
    script = ('read -r first; echo "$OPENAI_BASE_URL|$ANTHROPIC_BASE_URL|${REIN_ADMIN_TOKEN:-unset}|'
              '$([ "$OPENAI_API_KEY" = "$ANTHROPIC_API_KEY" ] && echo same)|$first|$1"')
    result = play(scripted.proxy.url, ["sh", "-c", script, "agent", "{api_key}"])
    answer = result.messages[-1]["content"]
    openai_url, anthropic_url, token, same, first_line, key = answer.split("|")
    assert (openai_url, anthropic_url) == (f"{scripted.proxy.url}/v1", scripted.proxy.url)
    assert (token, same) == ("unset", "same")
    assert first_line.startswith("Compute 417 * 38.") and key.startswith("rein-sk-")
    assert result.outcome == "truncated", "no answer in the task's format: the episode wanted another turn"

