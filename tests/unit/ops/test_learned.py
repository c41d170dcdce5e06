"""The demo's "learned" verdict: the rule of docs/task.md, per task, on flat, noisy and rising series."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ops.learned import BARS, judge


def test_the_recorded_runs_get_what_the_documented_rule_says() -> None:
    # docs/demo.md's recorded number-guessing runs and docs/models.md's SmolLM2 run (start, end of 5 steps)
    for start, end in [(0.054, 0.195), (0.059, 0.182), (0.080, 0.103)]:
        assert judge("guess_number", [start] * 5 + [end] * 5).learned is False
    assert judge("arithmetic", [0.068] * 5 + [0.195] * 5).learned is False


def test_a_rise_of_the_bar_to_above_the_floor_is_learned() -> None:
    verdict = judge("guess_number", [0.06] * 5 + [0.3] * 10 + [0.41] * 5)
    assert (verdict.start, verdict.end) == pytest.approx((0.06, 0.41))
    assert verdict.window == 5 and verdict.learned is True
    assert judge("arithmetic", [0.07] * 5 + [0.25] * 5).learned is True


@pytest.mark.parametrize(("start", "end", "learned"), [
    (0.05, 0.20, False),  # rise 0.15 but not above 0.219
    (0.10, 0.24, False),  # above 0.219 but a rise of 0.14
    (0.07, 0.22, True),
])
def test_both_conditions_are_needed(start: float, end: float, learned: bool) -> None:
    assert judge("guess_number", [start] * 5 + [end] * 5).learned is learned


def test_short_runs_use_a_quarter_of_the_run_and_no_rows_learn_nothing() -> None:
    verdict = judge("arithmetic", [0.1 * i for i in range(1, 9)])
    assert verdict.window == 2 and verdict.learned is True  # 0.15 -> 0.75
    empty = judge("guess_number", [])
    assert (empty.start, empty.end, empty.learned) == (None, None, False)


def test_a_task_without_a_documented_bar_gets_no_verdict() -> None:
    verdict = judge("some_new_task", [0.0] * 5 + [1.0] * 5)
    assert verdict.learned is None and verdict.end == 1.0


@given(
    task=st.sampled_from(sorted(BARS)),
    level=st.floats(0.0, 0.6),
    noise=st.lists(st.floats(-0.07, 0.07), min_size=1, max_size=300),
)
def test_a_flat_series_with_noise_below_the_bar_is_never_learned(task: str, level: float, noise: list[float]) -> None:
    """Noise of amplitude < rise/2 can never make the last window's mean exceed the first's by the rise."""
    assert judge(task, [level + n for n in noise]).learned is False


@given(
    task=st.sampled_from(sorted(BARS)),
    steps=st.integers(20, 300),
    noise=st.lists(st.floats(-0.05, 0.05), min_size=300, max_size=300),
)
def test_a_clear_rise_with_noise_is_learned(task: str, steps: int, noise: list[float]) -> None:
    """A linear rise from 0.05 to 0.5 (clear of both bars by more than the noise) is learned."""
    rewards = [0.05 + 0.45 * i / (steps - 1) + noise[i] for i in range(steps)]
    assert judge(task, rewards).learned is True
