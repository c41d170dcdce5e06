"""The tasks by name (``REIN_TASK``, ``make demo --task``): a new task is its module plus one entry here."""

from __future__ import annotations

from collections.abc import Callable

from services.rollout.arithmetic import ArithmeticTask
from services.rollout.calculator import CalculatorTask
from services.rollout.task import NumberGuessTask, Task
from shared.registry import Registry

TASKS: Registry[Callable[[], Task]] = Registry("task", {
    "guess_number": NumberGuessTask,
    "arithmetic": ArithmeticTask,
    "calculator": CalculatorTask,
})
"""Task name -> factory of the task the rollout runner plays."""
