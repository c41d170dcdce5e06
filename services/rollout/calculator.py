"""Arithmetic with a calculator tool: a task that needs a tool call to be solved.

Pure code like :mod:`services.rollout.arithmetic`: no I/O, randomness only from the seed. The user
asks ``Compute 417 * 38.`` with operands large enough that a small model cannot do it in its
head, and offers one tool, ``calculator(expression)``, through the request's ``tools`` (so the
agent is an ordinary OpenAI tool loop: the proxy parses the model's calls into
``tool_calls``, the episode runs them and answers ``tool`` messages). The final reply is graded
as in the arithmetic task (``Answer: <integer>``: 1 right, 0.2 wrong, 0 without the format); a
reply with neither a call nor the format gets a reminder, and the grade is scaled by
``RETRY_SCALE`` per reminder. An episode ends after ``max_turns`` replies. It counts the calls
it was sent that were well formed (a known tool, an ``expression`` that evaluates) and those that
were not.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from services.rollout.arithmetic import ArithmeticEpisode, ArithmeticTask
from services.rollout.task import Message

MAX_TURNS = 4
OPS = ("+", "-", "*")

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}]
"""The tool the episode offers, in OpenAI's ``tools`` shape."""

INSTRUCTION = "Use the calculator tool, then end your reply with 'Answer: ' followed by the number."
REMINDER = "Call the calculator tool, or end your reply with 'Answer: ' followed by the number."

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
}
MAX_MAGNITUDE = 10**12
"""Larger intermediate values are refused (an expression cannot make the episode compute forever)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, ``+ - * /`` and parentheses; ValueError otherwise."""
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        raise ValueError(f"not an arithmetic expression: {expression[:80]!r}") from None

    def walk(node: ast.AST, depth: int = 0) -> int | float:
        if depth > 50:
            raise ValueError("expression nested too deeply")
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            value: int | float = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = walk(node.operand, depth + 1)
            value = -inner if isinstance(node.op, ast.USub) else inner
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            value = _BINARY[type(node.op)](left, right)
        else:
            raise ValueError(f"only numbers, + - * / and parentheses: {expression[:80]!r}")
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("a value too large")
        return value

    value = walk(tree)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def run_call(call: Mapping[str, Any]) -> tuple[str, bool]:
    """``(the tool message's content, well formed)`` for one OpenAI tool call."""
    function = call.get("function") or {}
    if function.get("name") != "calculator":
        return f"error: unknown tool {function.get('name')!r}; the only tool is calculator", False
    try:
        args = json.loads(function.get("arguments") or "{}")
        value = evaluate(str(args["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}", False
    return str(value), True


@dataclass
class CalculatorEpisode(ArithmeticEpisode):
    """One question: :class:`ArithmeticEpisode` with the calculator offered and its calls answered."""

    op: str = "*"
    max_turns: int = MAX_TURNS
    calls_ok: int = 0
    calls_bad: int = 0

    task: ClassVar[str] = "calculator"
    ops: ClassVar[tuple[str, ...]] = OPS
    instruction: ClassVar[str] = INSTRUCTION
    reminder: ClassVar[str] = REMINDER

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def reset(self, payload: dict[str, Any]) -> list[Message]:
        self.calls_ok = self.calls_bad = 0
        return super().reset(payload)

    def answer_calls(self, tool_calls: Sequence[Mapping[str, Any]]) -> list[Message]:
        answers: list[Message] = []
        for call in tool_calls:
            content, ok = run_call(call)
            self.calls_ok, self.calls_bad = self.calls_ok + ok, self.calls_bad + (not ok)
            answers.append({"role": "tool", "tool_call_id": str(call.get("id", "")), "content": content})
        return answers


@dataclass(frozen=True)
class CalculatorTask(ArithmeticTask):
    """Questions ``a op b`` with ``a`` in 100..999 and ``b`` in 10..99, drawn from the seed."""

    max_turns: int = MAX_TURNS
    name: str = "calculator"
    id_prefix: ClassVar[str] = "calc"

    def question(self, rng: random.Random) -> tuple[int, str, int]:
        return rng.randint(100, 999), rng.choice(OPS), rng.randint(10, 99)

    def episode(self) -> CalculatorEpisode:
        return CalculatorEpisode(max_turns=self.max_turns)
