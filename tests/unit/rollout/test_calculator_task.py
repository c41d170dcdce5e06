"""The calculator task: a tool the episode runs, a final answer it grades."""

from __future__ import annotations

import itertools
import json

import pytest

from services.rollout.arithmetic import RETRY_SCALE
from services.rollout.calculator import REMINDER, TOOLS, CalculatorEpisode, CalculatorTask, evaluate, run_call
from services.rollout.settings import RolloutSettings
from services.rollout.tasks import TASKS
from shared.settings import load


def call(expression: object, name: str = "calculator", call_id: str = "c1") -> dict[str, object]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps({"expression": expression})}}


@pytest.mark.parametrize(("text", "value"), [("417 * 38", 15846), ("(1 + 2) * -3", -9), ("7 / 2", 3.5), ("8 / 2", 4)])
def test_evaluate(text: str, value: float) -> None:
    assert evaluate(text) == value


@pytest.mark.parametrize("text", ["__import__('os')", "2 ** 100", "1 / 0", "9" * 14, "x + 1", "", "(" * 200 + "1"])
def test_evaluate_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        evaluate(text)


def test_run_call() -> None:
    assert run_call(call("12 * 3")) == ("36", True)
    assert run_call(call("12 *"))[1] is False
    assert run_call(call("1", name="search")) == ("error: unknown tool 'search'; the only tool is calculator", False)
    assert run_call({"id": "x", "function": {"name": "calculator", "arguments": "{not json"}})[1] is False
    assert run_call({"id": "x", "function": {"name": "calculator", "arguments": "{}"}})[1] is False


def episode(a: int = 417, op: str = "*", b: int = 38, max_turns: int = 4) -> CalculatorEpisode:
    ep = CalculatorEpisode()
    first = ep.reset({"a": a, "op": op, "b": b, "max_turns": max_turns})
    assert first == [{"role": "user", "content": f"Compute {a} {op} {b}. Use the calculator tool, then end your "
                      "reply with 'Answer: ' followed by the number."}]
    assert ep.tools == TOOLS
    return ep


def test_a_call_then_the_answer() -> None:
    ep = episode()
    tool = ep.step("", [call("417 * 38"), call("bad", call_id="c2")])
    assert tool is not None and [m["tool_call_id"] for m in tool] == ["c1", "c2"]
    assert tool[0] == {"role": "tool", "tool_call_id": "c1", "content": "15846"}
    assert tool[1]["content"].startswith("error: ")
    assert (ep.calls_ok, ep.calls_bad) == (1, 1)
    assert ep.step("The result is 15846.\nAnswer: 15846") is None
    assert ep.reward() == 1.0 and ep.status == "completed"


def test_reminders_scale_the_grade_and_turns_end_the_episode() -> None:
    ep = episode()
    assert ep.step("I think it is big.") == [{"role": "user", "content": REMINDER}]
    assert ep.step("Answer: 1") is None and ep.reward() == pytest.approx(0.2 * RETRY_SCALE)
    short = episode(max_turns=2)
    assert short.step("", [call("417 * 38")]) is not None
    assert short.step("", [call("417 * 38")]) is None and short.reward() == 0.0, "out of turns, no answer"
    with pytest.raises(RuntimeError):
        short.step("Answer: 15846")


def test_prompts_are_seeded_and_distinct_and_the_task_is_registered() -> None:
    a = list(itertools.islice(CalculatorTask().prompts(3), 50))
    assert a == list(itertools.islice(CalculatorTask().prompts(3), 50))
    assert len({p.prompt_id for p in a}) == 50
    assert all(100 <= p.payload["a"] <= 999 and 10 <= p.payload["b"] <= 99 for p in a)
    assert isinstance(TASKS["calculator"](), CalculatorTask)
    with pytest.raises(ValueError):
        CalculatorEpisode().reset({"a": 1, "op": "**", "b": 2})


def test_calculator_can_be_chosen_by_setting() -> None:
    assert load(RolloutSettings, task="calculator").task == "calculator"
