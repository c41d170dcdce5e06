"""The built-in tasks by name (``REIN_TASK``)."""

from __future__ import annotations

from collections.abc import Callable

from services.rollout.arithmetic import ArithmeticTask
from services.rollout.calculator import CalculatorTask
from services.rollout.task import NumberGuessTask, Task

TASKS: dict[str, Callable[[], Task]] = {
    "guess_number": NumberGuessTask, "arithmetic": ArithmeticTask, "calculator": CalculatorTask,
}
"""Task name (``REIN_TASK``) -> factory."""
