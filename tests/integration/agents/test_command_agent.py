"""The rollout runner's black-box agent (``REIN_AGENT_COMMAND``): a real CLI from PyPI (``llm``), given only
the session's base URL and key, plays a calculator episode through a real proxy on a scripted engine; its
stdout is graded and the reward posted by the session. A command that fails or hangs ends its episode as
failed, and the agent never sees the runner's ``REIN_*`` settings."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.rollout.agent import EpisodeResult, SessionIds
from services.rollout.calculator import CalculatorEpisode
from services.rollout.command_agent import CommandAgent
from services.rollout.proxy_http import ProxyHttp
from shared.lender import Lender
from shared.schemas import SessionFinished
from tests.support.proxy import RUNNER, count_records, proxy_factory
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
        http = ProxyHttp(proxy_url, {"Authorization": f"Bearer {RUNNER}"}, 30.0)
        try:
            agent = CommandAgent(Lender(lambda: http), command=command, timeout_s=timeout_s, proxy_url=proxy_url,
                                 model="m", max_tokens=200, temperature=1.0)
            ids = SessionIds(f"s-{uuid.uuid4().hex}", f"g-{uuid.uuid4().hex}", "p-417", 0)
            return await agent.run(episode, dict(PAYLOAD), ids)
        finally:
            await http.aclose()

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
    assert not result.on_record, "no call reached the proxy: it records no end (the runner ends the session as lost)"
    assert count_records(scripted.proxy.bootstrap, scripted.proxy.settings.topics.events) == 0


FORGER = r"""
import base64, json, os, sys, httpx, openai
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
raw_id = json.loads(base64.urlsafe_b64decode(key[len("rein-sk-"):].split(".")[0] + "=="))["s"]
openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(
    model="m", messages=[{"role": "user", "content": sys.stdin.readline()}])
root = base.removesuffix("/v1")
bearer, api_key = {"Authorization": f"Bearer {key}"}, {"x-api-key": key}
tries = {
    "finish key in path": ("POST", f"{base}/sessions/{key}/finish", {}),
    "finish key in path, key as bearer": ("POST", f"{base}/sessions/{key}/finish", bearer),
    "finish raw id, key as bearer": ("POST", f"{base}/sessions/{raw_id}/finish", bearer),
    "finish raw id, key as x-api-key": ("POST", f"{base}/sessions/{raw_id}/finish", api_key),
    "finish raw id, no credential": ("POST", f"{base}/sessions/{raw_id}/finish", {}),
    "finish under the session's base URL": ("POST", f"{root}/sessions/{key}/v1/sessions/{raw_id}/finish", bearer),
    "open a session": ("POST", f"{base}/sessions", bearer),
    "chat as its own id by header": ("POST", f"{base}/chat/completions", {**bearer, "X-Session-Id": raw_id}),
    "pause": ("POST", f"{base}/rollout/pause", bearer),
}
body = {"reward": 7.5, "status": "completed", "group_id": "g-forged", "model": "m",
        "messages": [{"role": "user", "content": "x"}]}
print(json.dumps({name: httpx.request(m, url, json=body, headers=h).status_code
                  for name, (m, url, h) in tries.items()}))
"""


def test_an_agent_cannot_post_its_own_reward_open_sessions_or_drive_others(scripted: Scripted) -> None:
    """The threat: an agent runs model-written commands with whatever its environment holds (the session's
    key). Every way it could record a reward, open a session or reach the control plane with that key is
    refused and records nothing; the runner's own finish, with the task's grade, is what ends the session."""
    result = play(scripted.proxy.url, [sys.executable, "-c", FORGER])
    statuses = json.loads(result.messages[-1]["content"])
    assert statuses.pop("chat as its own id by header") == 403
    assert statuses.pop("pause") == 401
    assert statuses.pop("finish under the session's base URL") == 404, "no such route under a session's base URL"
    refused = {name: code for name, code in statuses.items() if code not in (401, 403)}
    assert not refused, f"accepted with only the agent's key: {refused}"
    assert (result.reported, result.on_record) == (True, True), "the runner's finish went through"
    [end] = [r for r in scripted.proxy.records("events", 1) if isinstance(r, SessionFinished)]
    assert (end.session_id, end.reward, end.num_chunks) == (result.session_id, result.reward, 1)
    assert end.reward != 7.5
    assert count_records(scripted.proxy.bootstrap, scripted.proxy.settings.topics.events) == 1


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
    monkeypatch.setenv("REIN_ADMIN_TOKEN", "secret-of-the-operator")
    monkeypatch.setenv("REIN_RUNNER_TOKEN", RUNNER)
    script = ('read -r first; echo "$OPENAI_BASE_URL|$ANTHROPIC_BASE_URL|${REIN_ADMIN_TOKEN:-unset}|'
              '${REIN_RUNNER_TOKEN:-unset}|$([ "$OPENAI_API_KEY" = "$ANTHROPIC_API_KEY" ] && echo same)|$first|$1"')
    result = play(scripted.proxy.url, ["sh", "-c", script, "agent", "{api_key}"])
    answer = result.messages[-1]["content"]
    openai_url, anthropic_url, token, runner, same, first_line, key = answer.split("|")
    assert (openai_url, anthropic_url) == (f"{scripted.proxy.url}/v1", scripted.proxy.url)
    assert (token, runner, same) == ("unset", "unset", "same")
    assert first_line.startswith("Compute 417 * 38.") and key.startswith("rein-sk-")
    assert result.outcome == "truncated", "no answer in the task's format: the episode wanted another turn"

