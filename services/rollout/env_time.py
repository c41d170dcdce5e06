"""How long an environment step keeps an episode waiting: a tool call, a sandbox, the grader. Pure.

Agents spend much of an episode waiting on their environment, and that wait is what asynchrony
hides: a synchronous wave waits for its slowest episode while the engine and the trainer idle. The
built-in tasks answer at once, so a run can give them an environment time: each step (every answer
of the environment, the last one, the grading, included) waits a time drawn from a log-normal
distribution with the given median and sigma (sigma 0: always the median), without using a core.
A draw depends only on the seed and the step's place in the prompt stream (prompt, attempt,
episode of the group, turn), so two runs of one seed wait the same times whatever their schedule.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvTime:
    """Seconds each environment step waits; ``median_s`` 0 (the default): none."""

    median_s: float = 0.0
    sigma: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0:
            raise ValueError(f"environment time needs median_s >= 0 and sigma >= 0, got {self.median_s}, {self.sigma}")

    def draw(self, prompt_id: str, attempt: int, slot: int, turn: int) -> float:
        """The wait of step ``turn`` of episode ``slot`` of the group playing ``prompt_id`` (try ``attempt``)."""
        if self.median_s == 0:
            return 0.0
        if self.sigma == 0:
            return self.median_s
        rng = random.Random(f"{self.seed}:{prompt_id}:{attempt}:{slot}:{turn}")
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
