"""Bounded waiting on a condition: the tests' one replacement for sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from tests.support.procs import Proc

T = TypeVar("T")


def wait_until(
    cond: Callable[[], T],
    timeout_s: float = 30,
    what: str = "condition",
    proc: Proc | None = None,
    interval_s: float = 0.02,
) -> T:
    """Poll ``cond`` until it returns something truthy and return that; fail the test with ``what``
    (and ``proc``'s log tail, if given) when ``timeout_s`` passes or ``proc`` dies first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and not proc.alive():
            pytest.fail(f"{proc.module} died while waiting for {what}; log:\n{proc.tail()}")
        if time.monotonic() > deadline:
            tail = f"; log:\n{proc.tail()}" if proc is not None else ""
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}{tail}")
        time.sleep(interval_s)
