"""Arithmetic for instruct models: a question, a required answer format, an exact grade.

Pure code like :mod:`services.rollout.task`: no I/O, randomness only from the seed.
The user asks ``Compute 17 + 5.`` and says how to answer, with one worked example: end the
reply with ``Answer: <integer>``. The reply is graded from its text alone:

- the format is kept when the reply's last non-empty line ends with ``Answer: <integer>`` (case,
  spaces, quotes and a final period ignored, a leading minus allowed);
- reward ``1`` for the right number in that format, ``FORMAT_REWARD`` (0.2) for a wrong number in
  that format, ``0`` without the format.

Multi-turn where the task needs it: a reply without the format gets one reminder of it (the
environment's second user message), and the second reply is graded with its reward scaled by
``RETRY_SCALE`` (0.5); so the best return needs the format the first time. A reply in the format
ends the episode whether right or wrong, so the grade cannot be searched turn by turn.

Small numbers on purpose (operands 0..``MAX_OPERAND``, ``+`` and ``-``). Measured with
SmolLM2-135M-Instruct sampled at temperature 1 (docs/models.md): without the worked example it
kept the format in 0 of 16 replies, so every group had the same reward and no gradient; with it,
about a quarter of replies keep the format, so most groups of 4 carry a signal, and few are right,
which leaves room for RL to raise both.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.rollout.task import EpisodeStatus, Message, Prompt

MAX_OPERAND = 20
SMALL_MAX_OPERAND = 9
"""Operands of ``arithmetic_small``: the untrained SmolLM2 gets some answers right there, none at 0..20
(bench/task_signal.py, docs/benchmarks.md), so its groups carry a signal past the format."""
MAX_TURNS = 2
FORMAT_REWARD = 0.2
RETRY_SCALE = 0.5
OPS = ("+", "-")

INSTRUCTION = (
    "End your reply with 'Answer: ' followed by the number. For example, for 2 + 3 you would end with: Answer: 5"
)
REMINDER = "End your reply with 'Answer: ' followed by the number, for example: Answer: 5"

_ANSWER = re.compile(r"answer\s*:\s*[\"']?(-?\d+)[\"']?\s*\.?\s*$", re.IGNORECASE)


def parse_answer(text: str) -> int | None:
    """The integer of a last non-empty line ending with ``Answer: <integer>``, else None (format not kept)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    match = _ANSWER.search(lines[-1].strip("*` "))
    return int(match.group(1)) if match else None


def solve(a: int, op: str, b: int) -> int:
    """The exact result of ``a op b`` (``+`` and ``-``; ``*`` for the calculator task)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; the tasks use + - *")


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
    reminders: int = 0
    done: bool = False
    score: float = 0.0
    replies: list[str] = field(default_factory=list)

    task: ClassVar[str] = "arithmetic"
    ops: ClassVar[tuple[str, ...]] = OPS
    instruction: ClassVar[str] = INSTRUCTION
    reminder: ClassVar[str] = REMINDER

    @property
    def expected(self) -> int:
        return solve(self.a, self.op, self.b)

    def reset(self, payload: dict[str, Any]) -> list[Message]:
        try:
            self.a, self.b = int(payload["a"]), int(payload["b"])
            self.op = str(payload["op"])
            self.max_turns = int(payload.get("max_turns", type(self).max_turns))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad {self.task} payload {payload!r}: {exc}") from None
        if self.op not in self.ops:
            raise ValueError(f"bad {self.task} payload {payload!r}: op must be one of {self.ops}")
        if self.max_turns < 1:
            raise ValueError(f"bad {self.task} payload {payload!r}: max_turns must be at least 1")
        self.turns, self.reminders, self.done, self.score, self.replies = 0, 0, False, 0.0, []
        return [{"role": "user", "content": f"Compute {self.a} {self.op} {self.b}. {self.instruction}"}]

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """No tools."""
        return None

    def answer_calls(self, tool_calls: Sequence[Mapping[str, Any]]) -> list[Message] | None:
        """The ``tool`` messages for a reply's calls; None: the task has no tools, the reply is judged as text."""
        return None

    def step(self, assistant_text: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> list[Message] | None:
        if self.done:
            raise RuntimeError("step() called on a finished episode")
        self.turns += 1
        self.replies.append(assistant_text)
        reward, kept = grade(assistant_text, self.expected)
        if kept or self.turns >= self.max_turns:
            self.done = True
            self.score = reward * RETRY_SCALE ** self.reminders
            return None
        answers = self.answer_calls(tool_calls) if tool_calls else None
        if answers is not None:
            return answers
        self.reminders += 1
        return [{"role": "user", "content": self.reminder}]

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
    id_prefix: ClassVar[str] = "ar"

    def question(self, rng: random.Random) -> tuple[int, str, int]:
        """``(a, op, b)`` of the next prompt."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return a, rng.choice(OPS), b

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        index = 0
        while True:
            a, op, b = self.question(rng)
            payload = {"task": self.name, "a": a, "op": op, "b": b, "max_turns": self.max_turns}
            yield Prompt(prompt_id=f"{self.id_prefix}-s{seed}-{index:07d}", payload=payload)
            index += 1

    def episode(self) -> ArithmeticEpisode:
        return ArithmeticEpisode(max_turns=self.max_turns)
