"""A task registered in ``TASKS`` is a rollout setting, a demo choice, a settings-reference row, and what
the runner plays through its agent (here against a scripted proxy in memory, no network)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from services.rollout.agent import Agent, SessionIds
from services.rollout.proxy_http import Answer, ProxyHttp
from services.rollout.runner import Runner
from services.rollout.settings import RolloutSettings
from services.rollout.task import EpisodeStatus, Message, Prompt
from services.rollout.tasks import TASKS
from shared.lender import Lender
from shared.settings import load
from tests.support.registry import RegisteredChoice


@dataclass
class EchoEpisode:
    """One turn: reward 1 when the reply is the payload's word."""

    word: str = ""
    said: str = ""
    tools: list[dict[str, Any]] | None = None
    status: EpisodeStatus = "completed"

    def reset(self, payload: dict[str, Any]) -> list[Message]:
        self.word = str(payload["word"])
        return [{"role": "user", "content": f"say {self.word}"}]

    def step(self, assistant_text: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> list[Message] | None:
        self.said = assistant_text
        return None  # the episode is over

    def reward(self) -> float:
        return float(self.said == self.word)


@dataclass(frozen=True)
class EchoTask:
    name: str = "echo"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        for index in itertools.count():
            yield Prompt(f"echo-s{seed}-{index}", {"task": self.name, "word": "yes"})

    def episode(self) -> EchoEpisode:
        return EchoEpisode()


TASK = RegisteredChoice(RolloutSettings, "task", "--task", TASKS)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The echo task (docs/architecture.md's example), for one test (monkeypatch removes it after it)."""
    monkeypatch.setitem(TASKS, "echo", EchoTask)


class ScriptedProxy(ProxyHttp):
    """Answers every chat call with ``reply`` and every finish with 200, in memory."""

    def __init__(self, reply: str) -> None:
        super().__init__("http://proxy", {}, timeout_s=1.0)  # its connection pool is never used
        self.reply = reply
        self.posts: list[tuple[str, Any]] = []

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Answer:
        self.posts.append((path, body))
        if path == "/v1/chat/completions":
            return Answer(200, {"choices": [{"message": {"role": "assistant", "content": self.reply}}]})
        return Answer(200, {})


def test_a_registered_task_is_a_setting_and_a_demo_choice(registered: None) -> None:
    TASK.assert_chosen("echo")
    assert TASK.reference_row() == "`guess_number` \\| `arithmetic` \\| `arithmetic_small` \\| `calculator` \\| `echo`"


def test_an_unknown_task_names_every_registered_one(registered: None) -> None:
    TASK.assert_refused("chess", "guess_number, arithmetic, arithmetic_small, calculator, echo")


def test_unregistered_after_the_test() -> None:
    TASK.assert_unregistered("echo")


def test_the_runner_plays_a_registered_task(registered: None) -> None:
    runner = Runner(load(RolloutSettings, task="echo"))
    assert isinstance(runner.task, EchoTask)
    proxy = ScriptedProxy("yes")
    agent = Agent(Lender(lambda: proxy), proxy_url="http://proxy", model="m", max_tokens=1, temperature=1.0)
    prompt = next(runner.task.prompts(0))
    result = asyncio.run(agent.run(runner.task.episode(), prompt.payload, SessionIds("s", "g", prompt.prompt_id, 0)))
    assert (result.outcome, result.reward, result.turns) == ("completed", 1.0, 1)
    assert [path for path, _ in proxy.posts] == ["/v1/chat/completions", "/v1/sessions/s/finish"]
    assert proxy.posts[0][1]["messages"][0] == {"role": "user", "content": "say yes"}
