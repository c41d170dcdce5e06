"""A foreign member of a consumer group: joining and leaving forces two rebalances on the others."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from types import TracebackType

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.coordinator.assignors.range import RangePartitionAssignor


class ForeignMember:
    """A plain kafka-python consumer in ``group_id`` on ``topics``, polling on its own thread.

    It never commits, so every record it reads is read again by whoever owns the partition
    next. Entering waits until it joined the group (the others' partitions were revoked and
    re-assigned; it may get none, e.g. of a one-partition topic); leaving closes it (they
    are revoked and re-assigned once more).
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
        self._joined = threading.Event()
        member = self

        class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            def on_partitions_revoked(self, revoked: object) -> None:
                return

            def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
                member.partitions = {(tp.topic, tp.partition) for tp in assigned}
                member._joined.set()  # called after every join, also with no partition

        self.records = 0
        self.partitions: set[tuple[str, int]] = set()
        """What the group gave it at its last join."""
        self._consumer.subscribe(list(topics), listener=Listener())
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-member", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for batch in self._consumer.poll(timeout_ms=100).values():
                self.records += len(batch)
        self._consumer.close(autocommit=False)

    def __enter__(self) -> ForeignMember:
        self._thread.start()
        if not self._joined.wait(self._timeout_s):
            self.__exit__(None, None, None)
            raise AssertionError(f"the foreign member did not join its group within {self._timeout_s}s")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s)
        assert not self._thread.is_alive(), "the foreign member did not leave"
