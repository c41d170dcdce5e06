"""Lend one client per concurrent call: the most recently returned idle one, or a new one.

Why clients lent one call at a time: a client of :mod:`shared.http_client` holds one connection and
sends one request at a time on it, so it needs no pool bookkeeping (httpcore's pool scanned every
idle connection, two syscalls each, whenever a request started or ended: with the hundred-odd
connections of a busy proxy, more of the proxy's CPU than anything else it did). Last returned,
first lent: under light load every call reuses the same warm connection, and the clients made stay
as many as the calls ever in flight at once.

Pure bookkeeping, no I/O; not thread-safe (one event loop uses it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class Lender(Generic[T]):
    """Items made by ``make`` on demand and lent one user at a time; see the module docstring."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self.items: list[T] = []
        """Every item made, lent or idle (the owner closes them at the end)."""
        self._idle: list[T] = []

    @property
    def lent(self) -> int:
        return len(self.items) - len(self._idle)

    @contextmanager
    def use(self) -> Iterator[T]:
        """An idle item (the last one returned) or a new one, lent until the block ends, however it ends."""
        if self._idle:
            item = self._idle.pop()
        else:
            item = self._make()
            self.items.append(item)
        try:
            yield item
        finally:
            self._idle.append(item)
