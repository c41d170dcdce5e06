"""One consumer's offset bookkeeping: what was delivered, what is done, what may be committed. Pure.

Every Kafka consumer in rein (collector, trainer, rollout runner, broadcaster) uses this
one model, through :class:`shared.bus.Consumer`:

- A record is *delivered* once per assignment. Kafka redelivers after any rebalance
  (the new owner, or the same member after a rejoin, restarts from the last committed
  offset): state is scoped to the current assignment of a partition, dropped on revoke
  and rebuilt from nothing on assign. A delivery at an offset already tracked in this
  assignment is a *re-delivery* and is not new work (:meth:`Offsets.deliver` says so).
- A record is *done* when its work is durable. ``done`` is idempotent: marking an offset
  twice, or one of a partition no longer assigned, changes nothing and never raises
  (the work is real either way; it just has no say in this assignment's commits).
- The position to *commit* on a partition is the lowest offset delivered and not done,
  or one past the highest delivered offset when everything delivered is done. It never
  passes an offset whose work is not done; gaps (compacted or skipped offsets) are fine
  because within one assignment a partition is delivered in offset order.

A duplicate *publish* (the same unit of work at a new offset) is the consumer's business:
it attaches the new position to the work it already has and marks it done with that work.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

TopicPartition = tuple[str, int]
"""``(topic, partition)``."""


@dataclass
class _Partition:
    """One partition in the current assignment."""

    highest: int = -1
    """Highest offset delivered (-1: none yet)."""
    open: set[int] = field(default_factory=set)
    """Offsets delivered and not done."""
    heap: list[int] = field(default_factory=list)
    """Min-heap over ``open`` with lazy deletion."""
    delivered: set[int] = field(default_factory=set)
    """Every offset delivered in this assignment (to tell re-deliveries from new records)."""
    committed: int = -1
    """Last position committed (or reported committed) in this assignment."""

    def position(self) -> int | None:
        while self.heap and self.heap[0] not in self.open:
            heapq.heappop(self.heap)
        if self.heap:
            return self.heap[0]
        return self.highest + 1 if self.highest >= 0 else None


class Offsets:
    """Delivered / done / committable offsets per partition; see the module docstring."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _Partition] = {}

    # ------------------------------------------------------------------ assignment

    def assign(self, tps: Iterable[TopicPartition]) -> None:
        """Partitions were assigned: each starts empty (fetching restarts from its committed offset)."""
        for tp in tps:
            self._parts[tp] = _Partition()

    def revoke(self, tps: Iterable[TopicPartition]) -> None:
        """Partitions were revoked: forget them; later ``done`` calls for them are no-ops."""
        for tp in tps:
            self._parts.pop(tp, None)

    # ------------------------------------------------------------------ records

    def deliver(self, tp: TopicPartition, offset: int) -> bool:
        """A record was read. True: new work, now open. False: a re-delivery in this assignment, ignore it.

        A partition not assigned through :meth:`assign` (a consumer without a group assigns
        itself) starts being tracked at its first delivery."""
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition()
        if offset in part.delivered or offset < part.committed:
            return False
        part.delivered.add(offset)
        part.highest = max(part.highest, offset)
        part.open.add(offset)
        heapq.heappush(part.heap, offset)
        return True

    def last(self, tp: TopicPartition) -> int | None:
        """Highest offset delivered on ``tp`` in this assignment (None: nothing yet)."""
        part = self._parts.get(tp)
        return part.highest if part is not None and part.highest >= 0 else None

    def done(self, tp: TopicPartition, offset: int) -> bool:
        """The record's work is durable. True if that closed an open offset; False (a no-op) otherwise."""
        part = self._parts.get(tp)
        if part is None or offset not in part.open:
            return False
        part.open.discard(offset)
        return True

    def is_open(self, tp: TopicPartition, offset: int) -> bool:
        part = self._parts.get(tp)
        return part is not None and offset in part.open

    # ------------------------------------------------------------------ commits

    def to_commit(self) -> dict[TopicPartition, int]:
        """``tp -> next offset to read`` for every partition whose position advanced since the last commit."""
        out: dict[TopicPartition, int] = {}
        for tp, part in self._parts.items():
            position = part.position()
            if position is not None and position > part.committed:
                out[tp] = position
        return out

    def committed(self, positions: dict[TopicPartition, int]) -> None:
        """Kafka took these positions. Delivered offsets below them are forgotten (memory stays bounded)."""
        for tp, position in positions.items():
            part = self._parts.get(tp)
            if part is None or position <= part.committed:
                continue
            part.committed = position
            part.delivered = {o for o in part.delivered if o >= position}
