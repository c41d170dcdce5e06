"""Environment time: seeded, per step, log-normal around its median."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.rollout.env_time import EnvTime


def test_none_by_default_and_the_median_without_sigma() -> None:
    assert EnvTime().draw("p", 0, 0, 1) == 0.0
    assert EnvTime(median_s=0.25).draw("p", 3, 7, 2) == 0.25


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_draws_are_log_normal_around_the_median(sigma: float) -> None:
    env = EnvTime(median_s=0.1, sigma=sigma, seed=4)
    draws = [env.draw(f"gn-s4-{i:07d}", 0, slot, turn) for i in range(200) for slot in range(4) for turn in (1, 2)]
    logs = [math.log(d / 0.1) for d in draws]
    assert statistics.median(draws) == pytest.approx(0.1, rel=0.15)
    assert statistics.pstdev(logs) == pytest.approx(sigma, rel=0.1)


@given(st.text(max_size=20), st.integers(0, 5), st.integers(0, 15), st.integers(1, 10), st.integers(0, 3))
def test_a_step_waits_the_same_in_every_run_of_a_seed(prompt: str, attempt: int, slot: int, turn: int,
                                                      seed: int) -> None:
    a, b = EnvTime(0.2, 1.0, seed), EnvTime(0.2, 1.0, seed)
    assert a.draw(prompt, attempt, slot, turn) == b.draw(prompt, attempt, slot, turn) > 0


def test_steps_episodes_and_seeds_wait_differently() -> None:
    env = EnvTime(0.2, 1.0, seed=0)
    base = env.draw("p", 0, 0, 1)
    assert len({base, env.draw("p", 0, 0, 2), env.draw("p", 0, 1, 1), env.draw("p", 1, 0, 1),
                env.draw("q", 0, 0, 1), EnvTime(0.2, 1.0, seed=1).draw("p", 0, 0, 1)}) == 6


@pytest.mark.parametrize(("median", "sigma"), [(-0.1, 0.0), (0.1, -1.0)])
def test_negative_settings_are_refused(median: float, sigma: float) -> None:
    with pytest.raises(ValueError, match="environment time"):
        EnvTime(median, sigma)
