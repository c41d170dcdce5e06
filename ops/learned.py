"""Whether a run learned its task: the rule of docs/task.md ("What 'learned' means"), thresholds here only.

A run has learned when the mean reward of its last steps exceeds the mean of its first steps
by at least :attr:`Bar.rise` *and* exceeds the task's :attr:`Bar.floor`. Ending merely higher
than it started is not enough: per-batch rewards are noisy, so a flat run would "learn" about
half the time. Pure, so the demo's summary and the tests share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WINDOW = 5
"""Steps averaged at each end of the run (a quarter of the run when it has fewer than 20)."""


@dataclass(frozen=True)
class Bar:
    rise: float
    """The end's mean must exceed the start's by at least this much."""
    floor: float
    """... and exceed this reward."""


BARS: dict[str, Bar] = {
    # 0.219: the best reward of a policy that ignores the environment's answers (docs/task.md, Baselines)
    "guess_number": Bar(rise=0.15, floor=0.219),
    # 0.2: every reply in the `Answer: <n>` format with a wrong number; above it some answers are right
    "arithmetic": Bar(rise=0.15, floor=0.2),
    "arithmetic_small": Bar(rise=0.15, floor=0.2),
}


@dataclass(frozen=True)
class Verdict:
    start: float | None
    """Mean reward of the first ``window`` steps (None: no step had a reward)."""
    end: float | None
    """Mean reward of the last ``window`` steps."""
    window: int
    learned: bool | None
    """None when the task has no bar in :data:`BARS`."""


def window_of(steps: int) -> int:
    """Steps averaged at each end: :data:`WINDOW`, or a quarter of a shorter run (the two never overlap)."""
    return max(1, min(WINDOW, steps // 4))


def judge(task: str, rewards: Sequence[float]) -> Verdict:
    """The verdict on a run of ``task`` whose steps had mean rewards ``rewards``, in order."""
    k = window_of(len(rewards))
    if not rewards:
        return Verdict(None, None, k, False if task in BARS else None)
    start, end = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    bar = BARS.get(task)
    if bar is None:
        return Verdict(start, end, k, None)
    # rounded so that a rise of exactly the bar (0.20 - 0.05) is not lost to float error
    return Verdict(start, end, k, round(end - start, 9) >= bar.rise and end > bar.floor)
