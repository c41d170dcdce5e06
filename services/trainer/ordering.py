"""Manifests in index order, exactly once. Pure.

``train.batches`` may have several partitions, so manifests can arrive out of
index order, and a collector that crashed after producing may publish the same
index twice. :class:`ManifestOrder` buffers until the next expected index arrives
and drops duplicates. Which offsets may be committed is :mod:`shared.offsets`' job:
the loop marks a record done once the index it carries is in a durable checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Offered(Generic[T]):
    """What :meth:`ManifestOrder.offer` did with one manifest."""

    ready: list[tuple[int, T]]
    """Manifests now trainable, in index order (may include earlier buffered ones)."""
    duplicate: bool
    """The index was already trained or already buffered: the record is handled by being dropped."""


@dataclass
class ManifestOrder(Generic[T]):
    """Releases items in consecutive index order from ``next_index``; each index once."""

    next_index: int
    _buffer: dict[int, T] = field(default_factory=dict)

    def offer(self, index: int, item: T) -> Offered[T]:
        if index < self.next_index or index in self._buffer:
            return Offered(ready=[], duplicate=True)
        self._buffer[index] = item
        ready: list[tuple[int, T]] = []
        while self.next_index in self._buffer:
            ready.append((self.next_index, self._buffer.pop(self.next_index)))
            self.next_index += 1
        return Offered(ready=ready, duplicate=False)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def buffered_indices(self) -> list[int]:
        return sorted(self._buffer)
