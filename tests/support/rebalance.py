"""A foreign member of a consumer group: joining and leaving forces two rebalances on the others."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

from kafka import KafkaConsumer
from kafka.coordinator.assignors.range import RangePartitionAssignor


class ForeignMember:
    """A plain kafka-python consumer in ``group_id`` on ``topics``, polling on its own thread.

    It never commits, so every record it reads is read again by whoever owns the partition
    next. Entering waits until the group gave it partitions (the others were revoked and
    re-assigned); leaving closes it (they are revoked and re-assigned once more).
    """

    def __init__(self, bootstrap: str, group_id: str, topics: Sequence[str], timeout_s: float = 60.0) -> None:
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=10_000,
            heartbeat_interval_ms=1_000,
            partition_assignment_strategy=(RangePartitionAssignor,),
            client_id="test-foreign-member",
        )
        self._consumer.subscribe(list(topics))
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._assigned = threading.Event()
        self.records = 0
        self.partitions: set[tuple[str, int]] = set()
        self._thread = threading.Thread(target=self._run, name="foreign-member", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for batch in self._consumer.poll(timeout_ms=100).values():
                self.records += len(batch)
            assignment = self._consumer.assignment()
            if assignment:
                self.partitions = {(tp.topic, tp.partition) for tp in assignment}
                self._assigned.set()
        self._consumer.close(autocommit=False)

    def __enter__(self) -> ForeignMember:
        self._thread.start()
        if not self._assigned.wait(self._timeout_s):
            self.__exit__(None, None, None)
            raise AssertionError(f"the foreign member got no partition within {self._timeout_s}s")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s)
        assert not self._thread.is_alive(), "the foreign member did not leave"
