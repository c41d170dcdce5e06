"""Bounded waiting on a condition: the tests' one replacement for sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from ops.local.stack import LocalStack
from tests.support.procs import Proc

T = TypeVar("T")


def wait_until(
    cond: Callable[[], T],
    timeout_s: float = 30,
    what: str = "condition",
    proc: Proc | None = None,
    interval_s: float = 0.02,
    details: Callable[[], str] | None = None,
) -> T:
    """Poll ``cond`` until it returns something truthy and return that; fail the test with ``what``
    (and ``proc``'s log tail, or ``details()``, if given) when ``timeout_s`` passes or ``proc`` dies first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and not proc.alive():
            pytest.fail(f"{proc.module} died while waiting for {what}; log:\n{proc.tail()}")
        if time.monotonic() > deadline:
            tail = f"; log:\n{proc.tail()}" if proc is not None else ""
            more = f"\n{details()}" if details is not None else ""
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}{tail}{more}")
        time.sleep(interval_s)


def wait_on_stack(
    what: str,
    cond: Callable[[], bool],
    timeout_s: float,
    local: LocalStack,
    allow_dead: tuple[str, ...] = (),
    interval_s: float = 0.25,
) -> None:
    """:func:`wait_until` for an ``ops.local`` stack: also fails as soon as a service not in
    ``allow_dead`` has died (naming it, with its log's tail: a CI run keeps no files)."""
    logs = local.config.run_dir / "logs"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        dead = [s for s in local.stack.dead() if s.name not in allow_dead]
        assert not dead, f"{[s.name for s in dead]} died while waiting for {what}; logs in {logs}\n" + "\n".join(
            f"--- {s.name} (exit {s.proc.returncode if s.proc else None}):\n{s.tail(40)}" for s in dead)
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; logs in {logs}")
