"""Manifests in index order, exactly once, and which Kafka offsets are safe to commit. Pure.

``train.batches`` may have several partitions, so manifests can arrive out of
index order, and a collector that crashed after producing may publish the same
index twice. :class:`ManifestOrder` buffers until the next expected index arrives
and drops duplicates. :class:`OffsetBook` answers, per partition, the offset to
commit: everything before the first record that is still buffered or in training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
Pos = tuple[str, int]  # (topic, partition)


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


@dataclass
class OffsetBook:
    """Per partition: offsets seen and offsets still open (buffered or not yet durable).

    ``commit_positions`` gives, for each partition, the next offset to read after
    a restart: the smallest open offset, or one past the highest seen offset when
    nothing is open. Records are seen in offset order within a partition.
    """

    _seen: dict[Pos, int] = field(default_factory=dict)
    _open: dict[Pos, set[int]] = field(default_factory=dict)
    _committed: dict[Pos, int] = field(default_factory=dict)

    def seen(self, pos: Pos, offset: int, *, open_: bool) -> None:
        self._seen[pos] = max(offset, self._seen.get(pos, -1))
        if open_:
            self._open.setdefault(pos, set()).add(offset)

    def close(self, pos: Pos, offset: int) -> None:
        self._open.get(pos, set()).discard(offset)

    def commit_positions(self) -> dict[Pos, int]:
        """Positions that advanced since the last :meth:`committed` call."""
        out: dict[Pos, int] = {}
        for pos, last in self._seen.items():
            opened = self._open.get(pos)
            target = min(opened) if opened else last + 1
            if target > self._committed.get(pos, -1):
                out[pos] = target
        return out

    def committed(self, positions: dict[Pos, int]) -> None:
        for pos, target in positions.items():
            self._committed[pos] = max(target, self._committed.get(pos, -1))
