"""Arithmetic for instruct models: a question, a required answer format, an exact grade.

Pure code like :mod:`services.rollout.task`: no I/O, randomness only from the seed.
The user asks ``What is 17 + 25?`` and says how to answer: a last line ``Answer: <integer>``.
The reply is graded from its text alone:

- the format is kept when the reply's last non-empty line is ``Answer: <integer>`` (case and
  surrounding spaces ignored, a leading minus allowed);
- reward ``1`` for the right number in that format, ``FORMAT_REWARD`` (0.1) for a wrong number in
  that format, ``0`` without the format.

Multi-turn where the task needs it: a reply without the format gets one reminder of it (the
environment's second user message), and the second reply is graded with its reward scaled by
``RETRY_SCALE`` (0.5); so the best return needs the format the first time. A reply in the format
ends the episode whether right or wrong, so the grade cannot be searched turn by turn.

Small numbers on purpose (operands 0..``MAX_OPERAND``, ``+`` and ``-``): SmolLM2-135M-Instruct
answers such questions fluently but often wrongly and often ignores the format, which leaves room
for RL to raise both.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from services.rollout.task import EpisodeStatus, Message, Prompt

MAX_OPERAND = 50
MAX_TURNS = 2
FORMAT_REWARD = 0.1
RETRY_SCALE = 0.5
OPS = ("+", "-")

INSTRUCTION = "Think briefly if you need to, then give the result on a last line of the form: Answer: <number>"
REMINDER = "Please end with a last line of the form: Answer: <number>"

_ANSWER = re.compile(r"answer\s*:\s*(-?\d+)\s*\.?", re.IGNORECASE)


def parse_answer(text: str) -> int | None:
    """The integer of a last non-empty line ``Answer: <integer>``, else None (format not kept)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    match = _ANSWER.fullmatch(lines[-1].strip("*` "))
    return int(match.group(1)) if match else None


def solve(a: int, op: str, b: int) -> int:
    """The exact result of ``a op b`` for the task's operators."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    raise ValueError(f"unknown operator {op!r}; the task uses {OPS}")


def grade(text: str, expected: int) -> tuple[float, bool]:
    """``(reward, format kept)`` of one reply, before any retry scaling."""
    value = parse_answer(text)
    if value is None:
        return 0.0, False
    return (1.0 if value == expected else FORMAT_REWARD), True


@dataclass
class ArithmeticEpisode:
    """One question; see the module docstring for the rules."""

    a: int = 0
    op: str = "+"
    b: int = 0
    max_turns: int = MAX_TURNS
    turns: int = 0
    done: bool = False
    score: float = 0.0
    replies: list[str] = field(default_factory=list)

    @property
    def expected(self) -> int:
        return solve(self.a, self.op, self.b)

    def reset(self, payload: dict[str, Any]) -> list[Message]:
        try:
            self.a, self.b = int(payload["a"]), int(payload["b"])
            self.op = str(payload["op"])
            self.max_turns = int(payload.get("max_turns", MAX_TURNS))
            solve(self.a, self.op, self.b)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad arithmetic payload {payload!r}: {exc}") from None
        if self.max_turns < 1:
            raise ValueError(f"bad arithmetic payload {payload!r}: max_turns must be at least 1")
        self.turns, self.done, self.score, self.replies = 0, False, 0.0, []
        return [{"role": "user", "content": f"What is {self.a} {self.op} {self.b}? {INSTRUCTION}"}]

    def step(self, assistant_text: str) -> list[Message] | None:
        if self.done:
            raise RuntimeError("step() called on a finished episode")
        self.turns += 1
        self.replies.append(assistant_text)
        reward, kept = grade(assistant_text, self.expected)
        if kept or self.turns >= self.max_turns:
            self.done = True
            self.score = reward * RETRY_SCALE ** (self.turns - 1)
            return None
        return [{"role": "user", "content": REMINDER}]

    def reward(self) -> float:
        return self.score if self.done else 0.0

    @property
    def status(self) -> EpisodeStatus:
        return "completed"


@dataclass(frozen=True)
class ArithmeticTask:
    """Questions ``a op b`` with operands in ``0..max_operand``, drawn from the seed."""

    max_operand: int = MAX_OPERAND
    max_turns: int = MAX_TURNS
    name: str = "arithmetic"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        index = 0
        while True:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            payload = {"task": self.name, "a": a, "op": rng.choice(OPS), "b": b, "max_turns": self.max_turns}
            yield Prompt(prompt_id=f"ar-s{seed}-{index:07d}", payload=payload)
            index += 1

    def episode(self) -> ArithmeticEpisode:
        return ArithmeticEpisode(max_turns=self.max_turns)
