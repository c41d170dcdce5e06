"""What the runner dispatches next: retries first, a bound on groups in flight, sync waves.

Pure (no I/O, no clock), so every rule is unit-tested as a table. The runner calls
:meth:`Scheduler.take` whenever something changed (a group ended, a retry or a weight
version arrived) and dispatches what it gets; ``None`` means "nothing may start now".

Rules:

- Retries come before new prompts (the reference put a retried group at the back of
  the buffer, W14) and keep their prompt id and attempt; a retry seen twice (the
  collector re-published after a crash) is dispatched once.
- At most ``max_in_flight`` groups run at once; with ``max_groups`` > 0 no more than
  that many groups (retries included) are ever dispatched.
- Sync mode dispatches ``groups_per_step`` new groups per wave. The next wave opens
  once every group in flight has ended *and* a weight version with a higher sequence
  number than the newest one seen when the wave opened has been applied. Retries are
  not gated: the trainer's next batch may need them, so gating them could deadlock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from services.rollout.task import Prompt


@dataclass(frozen=True)
class RetrySource:
    """Where a retry request was read, so its offset is committed once it is dispatched."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class Work:
    """One group to dispatch."""

    prompt_id: str
    attempt: int
    payload: dict[str, Any]
    source: RetrySource | None = None
    """Set for a retry read from Kafka."""

    @property
    def kind(self) -> Literal["new", "retry"]:
        return "new" if self.attempt == 0 and self.source is None else "retry"


class Scheduler:
    """Dispatch decisions for one runner; see the module docstring."""

    def __init__(
        self,
        prompts: Iterator[Prompt],
        *,
        max_in_flight: int,
        mode: Literal["async", "sync"] = "async",
        groups_per_step: int = 1,
        max_groups: int = 0,
        weights_seq: int = -1,
        dedup_memory: int = 100_000,
    ) -> None:
        if max_in_flight < 1 or groups_per_step < 1 or max_groups < 0:
            raise ValueError("max_in_flight and groups_per_step must be >= 1, max_groups >= 0")
        self._prompts = prompts
        self._retries: deque[Work] = deque()
        self._requeued_new: deque[Work] = deque()
        self._seen_retries: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._dedup_memory = dedup_memory
        self.max_in_flight = max_in_flight
        self.mode = mode
        self.groups_per_step = groups_per_step
        self.max_groups = max_groups
        self.in_flight = 0
        self.dispatched = 0
        self.weights_seq = weights_seq
        """Newest applied weight sequence number seen."""
        self.wave = 0
        """Sync mode: index of the current wave."""
        self.wave_new = 0
        """Sync mode: new groups dispatched in the current wave."""
        self.wave_baseline = weights_seq
        """Sync mode: ``weights_seq`` when the current wave opened."""

    # ------------------------------------------------------------------ inputs

    def add_retry(self, work: Work) -> bool:
        """Queue a retry; False (and nothing queued) if this prompt/attempt was already seen."""
        key = (work.prompt_id, work.attempt)
        if key in self._seen_retries:
            return False
        self._seen_retries[key] = None
        if len(self._seen_retries) > self._dedup_memory:
            self._seen_retries.popitem(last=False)
        self._retries.append(work)
        return True

    def on_weights_applied(self, seq: int) -> None:
        self.weights_seq = max(self.weights_seq, seq)

    def on_group_done(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("on_group_done without a group in flight")
        self.in_flight -= 1

    # ------------------------------------------------------------------ decisions

    @property
    def pending_retries(self) -> int:
        return len(self._retries)

    @property
    def exhausted(self) -> bool:
        """No group will ever be dispatched again (``max_groups`` reached)."""
        return self.max_groups > 0 and self.dispatched >= self.max_groups

    @property
    def finished(self) -> bool:
        """Exhausted and nothing in flight: the runner may exit."""
        return self.exhausted and self.in_flight == 0

    @property
    def wave_full(self) -> bool:
        return self.mode == "sync" and self.wave_new >= self.groups_per_step

    @property
    def waiting_for_weights(self) -> bool:
        """Sync mode: the wave has ended and the next applied weight version has not arrived."""
        return self.wave_full and self.in_flight == 0 and self.weights_seq <= self.wave_baseline

    def open_next_wave(self) -> None:
        """Start the next sync wave now (the runner's bounded wait for weights ran out)."""
        self.wave += 1
        self.wave_new = 0
        self.wave_baseline = self.weights_seq

    def take(self) -> Work | None:
        """The next group to dispatch, or None if none may start now. Marks it in flight."""
        if self.in_flight >= self.max_in_flight or self.exhausted:
            return None
        work = self._next_retry()
        if work is None:
            work = self._next_new()
        if work is None:
            return None
        self.in_flight += 1
        self.dispatched += 1
        return work

    def give_back(self, work: Work) -> None:
        """Dispatching ``work`` failed (its record never reached Kafka): undo ``take``, keep it first in line."""
        self.in_flight -= 1
        self.dispatched -= 1
        if work.kind == "retry":
            self._retries.appendleft(work)
            return
        if self.mode == "sync":
            self.wave_new -= 1
        self._requeued_new.appendleft(work)

    def _next_retry(self) -> Work | None:
        return self._retries.popleft() if self._retries else None

    def _next_new(self) -> Work | None:
        if self.mode == "sync":
            if self.wave_full:
                if self.in_flight > 0 or self.weights_seq <= self.wave_baseline:
                    return None
                self.open_next_wave()
            if self.wave_new == 0:
                self.wave_baseline = self.weights_seq
            self.wave_new += 1
        if self._requeued_new:
            return self._requeued_new.popleft()
        prompt = next(self._prompts)
        return Work(prompt_id=prompt.prompt_id, attempt=0, payload=prompt.payload)


class OffsetTracker:
    """Commit offsets for records handled out of order: per partition, the next offset to
    commit is one past the longest run of handled offsets from the first one seen."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], set[int]] = {}
        self._handled: dict[tuple[str, int], set[int]] = {}
        self._committed: dict[tuple[str, int], int] = {}

    def seen(self, topic: str, partition: int, offset: int) -> None:
        """A record was read and is not yet handled."""
        self._pending.setdefault((topic, partition), set()).add(offset)

    def handled(self, topic: str, partition: int, offset: int) -> int | None:
        """The record is handled; the new commit offset for its partition, or None if unchanged."""
        tp = (topic, partition)
        pending = self._pending.get(tp, set())
        if offset not in pending:
            raise KeyError(f"offset {offset} of {topic}/{partition} was never seen or is already handled")
        pending.discard(offset)
        handled = self._handled.setdefault(tp, set())
        handled.add(offset)
        floor = min(pending) if pending else None
        done = [o for o in handled if floor is None or o < floor]
        if not done:
            return None
        new = max(done) + 1
        handled.difference_update(done)
        if new <= self._committed.get(tp, -1):
            return None
        self._committed[tp] = new
        return new


AVAILABILITY_ERRORS = frozenset({"unreachable", "timeout", "engine_unavailable", "kafka_unavailable"})
"""Episode errors that say the backend is down, not that the prompt or the policy failed."""


@dataclass
class BackendGate:
    """Slows dispatch to one probe group at a time while the backend is down.

    Every failed group costs its prompt one of ``max_retries`` attempts. Without this, an
    engine restart of a few seconds fails every group in flight and then their immediate
    retries, and prompts are dropped for an outage that was not theirs. Once a group fails
    only with :data:`AVAILABILITY_ERRORS` the gate closes: the runner waits for the groups
    in flight to end, then sends one group after ``delay_s``, doubling the delay (up to
    ``cap_s``) each time the probe fails too. The first group that gets through opens it.
    """

    first_s: float = 0.5
    cap_s: float = 10.0
    closed: bool = False
    delay_s: float = 0.0

    def on_group(self, backend_down: bool, probe: bool) -> None:
        """A group ended; ``backend_down``: all its sessions failed with an availability error."""
        if not backend_down:
            self.closed, self.delay_s = False, 0.0
        elif not self.closed:
            self.closed, self.delay_s = True, self.first_s
        elif probe:
            self.delay_s = min(self.delay_s * 2, self.cap_s)

    def may_dispatch(self, in_flight: int) -> bool:
        """Open, or closed with nothing in flight (the next group is a probe)."""
        return not self.closed or in_flight == 0
