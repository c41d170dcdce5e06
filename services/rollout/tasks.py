"""The tasks by name (``REIN_TASK``, ``make demo --task``): a new task is its module plus one entry here."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from services.rollout.arithmetic import SMALL_MAX_OPERAND, ArithmeticTask
from services.rollout.calculator import CalculatorTask
from services.rollout.task import NumberGuessTask, Task
from shared.registry import Registry

TASKS: Registry[Callable[[], Task]] = Registry("task", {
    "guess_number": NumberGuessTask,
    "arithmetic": ArithmeticTask,
    "arithmetic_small": partial(ArithmeticTask, max_operand=SMALL_MAX_OPERAND, name="arithmetic_small"),
    "calculator": CalculatorTask,
})
"""Task name -> factory of the task the rollout runner plays."""
