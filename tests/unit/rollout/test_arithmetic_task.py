"""The arithmetic task: answer parsing, grading, the reminder turn, determinism of the prompt stream."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.rollout.arithmetic import (
    FORMAT_REWARD,
    REMINDER,
    RETRY_SCALE,
    ArithmeticEpisode,
    ArithmeticTask,
    grade,
    parse_answer,
    solve,
)
from services.rollout.task import play
from services.rollout.tasks import TASKS


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Answer: 42", 42),
        ("17 + 25 = 42.\nAnswer: 42", 42),
        ("answer:-3", -3),
        ("ANSWER :  7 \n\n", 7),
        ("**Answer: 12**", 12),
        ("Answer: 12.", 12),
        ('A good one. "Answer: 8', 8),
        ("2 + 3, Answer: 5", 5),
        ("Answer: '7'", 7),
        ("The answer is 42", None),
        ("Answer: 42\nI hope this helps", None),
        ("Answer: forty-two", None),
        ("Answer: 4 2", None),
        ("", None),
        ("42", None),
    ],
)
def test_parse_answer(text: str, value: int | None) -> None:
    assert parse_answer(text) == value


def test_grade_table() -> None:
    assert grade("Answer: 42", 42) == (1.0, True)
    assert grade("Answer: 41", 42) == (FORMAT_REWARD, True)
    assert grade("42", 42) == (0.0, False)


def _episode(a: int = 17, op: str = "+", b: int = 25) -> tuple[ArithmeticEpisode, list[dict[str, str]]]:
    episode = ArithmeticTask().episode()
    return episode, episode.reset({"task": "arithmetic", "a": a, "op": op, "b": b, "max_turns": 2})


def test_right_answer_first_turn_ends_with_full_reward() -> None:
    episode, messages = _episode()
    assert messages == [{"role": "user", "content": messages[0]["content"]}]
    assert messages[0]["content"].startswith("Compute 17 + 25. End your reply with 'Answer: '")
    assert episode.step("17 + 25 = 42\nAnswer: 42") is None
    assert episode.reward() == 1.0
    assert episode.turns == 1


def test_wrong_number_in_format_ends_without_retry() -> None:
    episode, _ = _episode()
    assert episode.step("Answer: 32") is None
    assert episode.reward() == pytest.approx(FORMAT_REWARD)


def test_missing_format_gets_one_reminder_then_scaled_grade() -> None:
    episode, _ = _episode(9, "-", 12)
    assert episode.reward() == 0.0
    assert episode.step("It is minus three") == [{"role": "user", "content": REMINDER}]
    assert not episode.done and episode.reward() == 0.0
    assert episode.step("Answer: -3") is None
    assert episode.reward() == pytest.approx(RETRY_SCALE)
    with pytest.raises(RuntimeError):
        episode.step("Answer: -3")


def test_two_replies_without_format_score_zero() -> None:
    episode, _ = _episode()
    assert episode.step("42") is not None
    assert episode.step("42") is None
    assert episode.done and episode.reward() == 0.0


@pytest.mark.parametrize(
    "payload",
    [{}, {"a": 1, "op": "*", "b": 2}, {"a": "x", "op": "+", "b": 2}, {"a": 1, "op": "+", "b": 2, "max_turns": 0}],
)
def test_bad_payload_is_refused(payload: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="bad arithmetic payload"):
        ArithmeticTask().episode().reset(payload)  # type: ignore[arg-type]


def test_prompt_stream_is_seed_determined_with_unique_ids() -> None:
    task = TASKS["arithmetic"]()
    first = list(itertools.islice(task.prompts(3), 200))
    again = list(itertools.islice(task.prompts(3), 200))
    other = list(itertools.islice(task.prompts(4), 200))
    assert first == again
    assert [p.payload for p in first] != [p.payload for p in other]
    assert len({p.prompt_id for p in first}) == 200
    assert {p.payload["op"] for p in first} == {"+", "-"}
    assert all(0 <= p.payload["a"] <= 20 and 0 <= p.payload["b"] <= 20 for p in first)


def test_small_arithmetic_draws_single_digits_and_names_itself() -> None:
    """``arithmetic_small``: the same episode and grade on operands 0..9, its payloads tagged with its own name."""
    prompts = list(itertools.islice(TASKS["arithmetic_small"]().prompts(3), 200))
    assert {p.payload["a"] for p in prompts} | {p.payload["b"] for p in prompts} == set(range(10))
    assert {p.payload["task"] for p in prompts} == {"arithmetic_small"}
    p = prompts[0]
    episode = TASKS["arithmetic_small"]().episode()
    episode.reset(p.payload)
    assert episode.step(f"Answer: {solve(p.payload['a'], p.payload['op'], p.payload['b'])}") is None
    assert episode.reward() == 1.0


@given(st.integers(0, 50), st.sampled_from(["+", "-"]), st.integers(0, 50), st.booleans())
def test_exact_solver_policy_always_scores_one(a: int, op: str, b: int, chatty: bool) -> None:
    prefix = "Let me compute.\n" if chatty else ""
    reward, transcript = play(
        ArithmeticTask(),
        {"a": a, "op": op, "b": b, "max_turns": 2},
        lambda messages: f"{prefix}Answer: {solve(a, op, b)}",
    )
    assert reward == 1.0
    assert len(transcript) == 2
