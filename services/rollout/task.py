"""Tasks the rollout runner plays, and the built-in multi-turn one: number guessing.

Pure code: no I/O, no clock, randomness only from an explicit seed. A :class:`Task`
yields prompts (a stable id and a JSON-able payload that travels in
``GroupDispatched`` and ``RetryRequest`` records) and makes :class:`Episode` objects
that turn a payload into chat messages, judge each assistant reply, and give the
reward at the end.

Number guessing (``docs/task.md`` explains the choice): the secret is an integer in
``[low, high]`` (0..15) taken from the payload. The user says ``guess the number
between 0 and 15``; each assistant reply must be exactly one number in range; the
environment answers ``higher`` (the secret is above the guess), ``lower``, ``correct``
(the episode ends) or ``invalid`` (anything else; it still costs a turn). At most
``max_turns`` (5) replies. Reward ``1 - 0.15 * (turns - 1)`` when found, else 0.
Every word used is in ``shared.tokenizer.VOCAB``, the only words the policy knows.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Message = dict[str, str]
"""An OpenAI chat message: ``{"role": ..., "content": ...}``."""

Policy = Callable[[Sequence[Message]], str]
"""Maps the conversation so far to the assistant's next reply (for baselines and tests)."""

EpisodeStatus = Literal["completed", "truncated"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task; ``payload`` is everything an episode needs (JSON-able)."""

    prompt_id: str
    payload: dict[str, Any]


class Episode(Protocol):
    """One multi-turn episode. Lifecycle: ``reset`` once, ``step`` until it returns None, ``reward``."""

    def reset(self, payload: dict[str, Any]) -> list[Message]:
        """The first messages the agent sends."""
        ...

    def step(self, assistant_text: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> list[Message] | None:
        """Judge one assistant reply (its text, and its OpenAI ``tool_calls``): the environment's answer to
        append (``tool`` messages for calls), or None when the episode is over."""
        ...

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tools offered with every call (OpenAI's ``tools``), or None."""
        ...

    def reward(self) -> float:
        """The episode's return (valid once ``step`` returned None; 0 before)."""
        ...

    @property
    def status(self) -> EpisodeStatus:
        """How the episode ended, for the proxy's finish call."""
        ...


class Task(Protocol):
    """A source of prompts and a factory of episodes."""

    @property
    def name(self) -> str:
        """Short task name (``REIN_TASK``), also put in every prompt payload."""
        ...

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless, seed-determined stream of prompts with unique ids."""
        ...

    def episode(self) -> Episode:
        """A fresh episode (``reset`` it with a prompt payload)."""
        ...


# --------------------------------------------------------------------------- number guessing

LOW = 0
HIGH = 15
MAX_TURNS = 5
TURN_PENALTY = 0.15

HIGHER = "higher"
LOWER = "lower"
CORRECT = "correct"
INVALID = "invalid"


def guess_reward(turns: int, found: bool, turn_penalty: float = TURN_PENALTY) -> float:
    """``1 - turn_penalty * (turns - 1)`` when the secret was found on reply ``turns``, else 0."""
    if not found:
        return 0.0
    if turns < 1:
        raise ValueError(f"a found secret needs at least one turn, got {turns}")
    return 1.0 - turn_penalty * (turns - 1)


def parse_guess(text: str, low: int = LOW, high: int = HIGH) -> int | None:
    """The guessed number if ``text`` is exactly one canonical integer in ``[low, high]``, else None."""
    words = text.split()
    if len(words) != 1:
        return None
    word = words[0]
    if not word.isdigit() or str(int(word)) != word:
        return None
    value = int(word)
    return value if low <= value <= high else None


@dataclass
class GuessEpisode:
    """One game of number guessing; see the module docstring for the rules."""

    secret: int = -1
    low: int = LOW
    high: int = HIGH
    max_turns: int = MAX_TURNS
    turns: int = 0
    found: bool = False
    done: bool = False
    history: list[tuple[str, str]] = field(default_factory=list)
    """``(assistant reply, environment answer)`` per turn."""

    def reset(self, payload: dict[str, Any]) -> list[Message]:
        try:
            self.secret = int(payload["secret"])
            self.low = int(payload.get("low", LOW))
            self.high = int(payload.get("high", HIGH))
            self.max_turns = int(payload.get("max_turns", MAX_TURNS))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad number-guessing payload {payload!r}: {exc}") from None
        if not self.low <= self.secret <= self.high or self.max_turns < 1:
            raise ValueError(f"bad number-guessing payload {payload!r}: secret out of range or no turns")
        self.turns, self.found, self.done, self.history = 0, False, False, []
        return [{"role": "user", "content": f"guess the number between {self.low} and {self.high}"}]

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """No tools."""
        return None

    def step(self, assistant_text: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> list[Message] | None:
        if self.done:
            raise RuntimeError("step() called on a finished episode")
        self.turns += 1
        guess = parse_guess(assistant_text, self.low, self.high)
        if guess is None:
            answer = INVALID
        elif guess < self.secret:
            answer = HIGHER
        elif guess > self.secret:
            answer = LOWER
        else:
            answer = CORRECT
        self.history.append((assistant_text, answer))
        if answer == CORRECT:
            self.found, self.done = True, True
            return None
        if self.turns >= self.max_turns:
            self.done = True
            return None
        return [{"role": "user", "content": answer}]

    def reward(self) -> float:
        return guess_reward(self.turns, self.found) if self.done else 0.0

    @property
    def status(self) -> EpisodeStatus:
        # Running out of turns is part of the game (its true return is 0), not a truncation.
        return "completed"


@dataclass(frozen=True)
class NumberGuessTask:
    """The built-in task. Secrets come in shuffled blocks of all 16 values, so every
    stretch of 16 prompts covers each secret once (lower-variance reward curves)."""

    low: int = LOW
    high: int = HIGH
    max_turns: int = MAX_TURNS
    name: str = "guess_number"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        values = list(range(self.low, self.high + 1))
        index = 0
        while True:
            block = values[:]
            rng.shuffle(block)
            for secret in block:
                payload = {"task": self.name, "secret": secret, "low": self.low, "high": self.high,
                           "max_turns": self.max_turns}
                yield Prompt(prompt_id=f"gn-s{seed}-{index:07d}", payload=payload)
                index += 1

    def episode(self) -> GuessEpisode:
        return GuessEpisode(low=self.low, high=self.high, max_turns=self.max_turns)


# --------------------------------------------------------------------------- baselines (docs and tests)


def play(task: Task, payload: dict[str, Any], policy: Policy) -> tuple[float, list[Message]]:
    """Run one episode with a local policy; the reward and the full transcript."""
    episode = task.episode()
    messages = episode.reset(payload)
    while True:
        reply = policy(messages)
        messages.append({"role": "assistant", "content": reply})
        feedback = episode.step(reply)
        if feedback is None:
            return episode.reward(), messages
        messages.extend(feedback)


def binary_search_policy(messages: Sequence[Message]) -> str:
    """The optimal policy: halve the interval the feedback so far leaves open."""
    low, high = LOW, HIGH
    first = messages[0]["content"].split() if messages else []
    if len(first) == 6 and first[:4] == ["guess", "the", "number", "between"]:
        low, high = int(first[4]), int(first[5])
    for reply, answer in zip(messages[1::2], messages[2::2], strict=False):
        guess = parse_guess(reply["content"], low, high)
        if guess is None:
            continue
        if answer["content"] == HIGHER:
            low = guess + 1
        elif answer["content"] == LOWER:
            high = guess - 1
    return str((low + high) // 2)


def random_policy(rng: random.Random, choices: Sequence[str]) -> Policy:
    """Answers a uniformly random element of ``choices`` every turn, ignoring feedback."""
    return lambda _messages: rng.choice(list(choices))


def expected_reward_independent(p_hit: float, max_turns: int = MAX_TURNS, turn_penalty: float = TURN_PENALTY) -> float:
    """Exact expected reward of a policy that hits the secret with probability ``p_hit``
    on every turn independently (a random guesser)."""
    return sum(
        (1 - p_hit) ** (t - 1) * p_hit * guess_reward(t, True, turn_penalty) for t in range(1, max_turns + 1)
    )


def optimal_reward(task: NumberGuessTask | None = None) -> float:
    """Mean reward of binary search over every secret (the task's optimum: 0.64375 for 0..15)."""
    task = task or NumberGuessTask()
    secrets = range(task.low, task.high + 1)
    rewards = [
        play(task, {"secret": s, "low": task.low, "high": task.high, "max_turns": task.max_turns},
             binary_search_policy)[0]
        for s in secrets
    ]
    return sum(rewards) / len(rewards)


def simulate(task: Task, policy: Policy, episodes: int, seed: int) -> float:
    """Mean reward of ``policy`` over the first ``episodes`` prompts of ``task.prompts(seed)``."""
    prompts = task.prompts(seed)
    total = 0.0
    for _ in range(episodes):
        total += play(task, next(prompts).payload, policy)[0]
    return total / episodes
