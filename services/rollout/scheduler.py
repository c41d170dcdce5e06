"""What the runner dispatches next: retries first, a bound on groups in flight, sync waves.

Pure (no I/O, no clock), so every rule is unit-tested as a table. The runner calls
:meth:`Scheduler.take` whenever something changed (a group ended, a retry or a weight
version arrived) and dispatches what it gets; ``None`` means "nothing may start now".

Rules:

- Retries come before new prompts (queued behind new work, a retry would wait the
  longest of all) and keep their prompt id and attempt. A retry published twice (the
  collector re-published after a crash: same prompt and attempt, another offset) is
  dispatched once: the second record is attached to the first one's work and is done
  when that work is dispatched, or at once if it already was. A record delivered again
  (a rebalance) never reaches the scheduler: :class:`shared.offsets.Offsets` drops it.
- When retry partitions are revoked, queued retries read only from them are dropped:
  the partition's next owner (maybe this runner again) reads and dispatches them.
- At most ``max_in_flight`` groups run at once; with ``max_groups`` > 0 no more than
  that many groups (retries included) are ever dispatched.
- Sync mode dispatches ``groups_per_step`` new groups per wave. The next wave opens
  once every group in flight has ended *and* a weight version with a higher sequence
  number than the newest one seen when the wave opened has been applied, or the trainer
  skipped a batch with a higher index than the newest skip seen then (the batch had no
  gradient, so no version follows it). Retries are not gated: the trainer's next batch
  may need them, so gating them could deadlock.
- Sync mode tops its wave up when the collectors drop groups without signal: each such
  drop reported during the wave (:meth:`Scheduler.on_no_signal_drops`, the window's
  cumulative count) lets one more new group into it, so the wave still fills its batch with
  groups that carry signal. None is dispatched too many: the batch forms only once as many
  groups carried signal as it holds, so by then every drop of the wave has been reported
  and none of its groups is still in flight. The first report is a baseline (a restarted
  runner reads the drops of earlier waves).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from services.rollout.task import Prompt


class PromptStream:
    """A task's seed-determined prompt stream, read forward only.

    Unclaimed, every prompt is available in order. Claimed (the runner's durable cursor),
    a prompt is available only once :meth:`claim` named its index in the stream (the
    runner got it from a shared Redis counter), so a restarted runner, or a second one
    with the same seed, never dispatches a prompt id twice; indices claimed by others
    are skipped.
    """

    def __init__(self, prompts: Iterator[Prompt], *, claimed: bool = False) -> None:
        self._prompts = prompts
        self._claimed = claimed
        self._next_index = 0
        self._ready: deque[Prompt] = deque()

    def available(self) -> bool:
        return not self._claimed or bool(self._ready)

    def claim(self, index: int) -> None:
        """Make the prompt at ``index`` (0-based position in the stream) the next one; indices only grow."""
        if index < self._next_index:
            raise ValueError(f"prompt {index} is behind the stream (next is {self._next_index})")
        while self._next_index < index:
            next(self._prompts)
            self._next_index += 1
        self._ready.append(next(self._prompts))
        self._next_index += 1

    def take(self) -> Prompt:
        if self._claimed:
            return self._ready.popleft()
        self._next_index += 1
        return next(self._prompts)


@dataclass(frozen=True)
class RetrySource:
    """Where a retry request was read, so its offset is marked done once its group is dispatched."""

    topic: str
    partition: int
    offset: int


@dataclass
class Work:
    """One group to dispatch."""

    prompt_id: str
    attempt: int
    payload: dict[str, Any]
    sources: list[RetrySource] = field(default_factory=list)
    """For a retry: every record that asked for it (a duplicate publish adds one); done once it is dispatched."""
    kind: Literal["new", "retry"] = "new"
    free_retries: int = 0

    @property
    def key(self) -> tuple[str, int, int]:
        """One retry of one prompt (see :class:`shared.schemas.RetryRequest`)."""
        return (self.prompt_id, self.attempt, self.free_retries)


def retry_work(
    prompt_id: str, attempt: int, payload: dict[str, Any], source: RetrySource, free_retries: int = 0
) -> Work:
    return Work(prompt_id, attempt, payload, [source], "retry", free_retries)


AddOutcome = Literal["queued", "attached", "dispatched"]
"""What :meth:`Scheduler.add_retry` did: queued new work, attached the record to queued or
running work (done with it), or found the work already dispatched (the record is done now)."""


class Scheduler:
    """Dispatch decisions for one runner; see the module docstring."""

    def __init__(
        self,
        prompts: Iterator[Prompt] | PromptStream,
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
        self._prompts = prompts if isinstance(prompts, PromptStream) else PromptStream(prompts)
        self._retries: deque[Work] = deque()
        self._requeued_new: deque[Work] = deque()
        self._active: dict[tuple[str, int, int], Work] = {}
        """Retries queued or taken and not yet confirmed dispatched, by :attr:`Work.key`."""
        self._dispatched: OrderedDict[tuple[str, int, int], None] = OrderedDict()
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
        self.skipped_index = -1
        """Highest manifest index the trainer consumed without an update (``BatchSkipped``) seen."""
        self.wave_skip_baseline = -1
        """Sync mode: ``skipped_index`` when the current wave opened."""
        self.no_signal_drops: int | None = None
        """Cumulative groups the collectors dropped without signal, as last reported (None: no report yet)."""
        self.wave_drop_baseline = 0
        """Sync mode: ``no_signal_drops`` when the current wave opened."""

    # ------------------------------------------------------------------ inputs

    def add_retry(self, work: Work) -> AddOutcome:
        """Queue a retry, or attach its record to the same prompt/attempt's work; see :data:`AddOutcome`."""
        if work.key in self._dispatched:
            return "dispatched"
        held = self._active.get(work.key)
        if held is not None:
            held.sources.extend(s for s in work.sources if s not in held.sources)
            return "attached"
        self._active[work.key] = work
        self._retries.append(work)
        return "queued"

    def confirm(self, work: Work) -> list[RetrySource]:
        """``work`` was dispatched (its record is in Kafka): the retry records now done."""
        if work.kind != "retry":
            return []
        self._active.pop(work.key, None)
        self._dispatched[work.key] = None
        if len(self._dispatched) > self._dedup_memory:
            self._dispatched.popitem(last=False)
        return list(work.sources)

    def revoke(self, partitions: set[tuple[str, int]]) -> int:
        """Retry partitions were revoked: forget their records; drop queued retries left with none.

        A retry already taken keeps running (its dispatch is real); if it is given back with no
        record left, it is dropped then. Returns how many queued retries were dropped."""
        for work in self._active.values():
            work.sources[:] = [s for s in work.sources if (s.topic, s.partition) not in partitions]
        kept = deque(w for w in self._retries if w.sources)
        dropped = len(self._retries) - len(kept)
        for work in self._retries:
            if not work.sources:
                self._active.pop(work.key, None)
        self._retries = kept
        return dropped

    def on_weights_applied(self, seq: int) -> None:
        self.weights_seq = max(self.weights_seq, seq)

    def on_batch_skipped(self, index: int) -> None:
        """The trainer consumed manifest ``index`` and kept its weights: releases a sync wave like a version."""
        self.skipped_index = max(self.skipped_index, index)

    def on_no_signal_drops(self, total: int) -> None:
        """The window's cumulative count of groups dropped without signal (sync mode tops its wave up)."""
        if self.no_signal_drops is None:
            self.wave_drop_baseline = total  # drops before this runner's first report belong to no wave of its
        self.no_signal_drops = max(self.no_signal_drops or 0, total)

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
    def wave_target(self) -> int:
        """Sync mode: new groups the current wave dispatches, ``groups_per_step`` plus its no-signal drops."""
        return self.groups_per_step + max(0, (self.no_signal_drops or 0) - self.wave_drop_baseline)

    @property
    def wave_full(self) -> bool:
        return self.mode == "sync" and self.wave_new >= self.wave_target

    @property
    def _released(self) -> bool:
        """Sync mode: a version was applied, or a batch skipped, since the current wave opened."""
        return self.weights_seq > self.wave_baseline or self.skipped_index > self.wave_skip_baseline

    @property
    def waiting_for_weights(self) -> bool:
        """Sync mode: the wave has ended and neither the next applied weight version nor a skip has arrived."""
        return self.wave_full and self.in_flight == 0 and not self._released

    def open_next_wave(self) -> None:
        """Start the next sync wave now (the runner's bounded wait for weights ran out)."""
        self.wave += 1
        self.wave_new = 0
        self._mark_baseline()

    def _mark_baseline(self) -> None:
        self.wave_baseline = self.weights_seq
        self.wave_skip_baseline = self.skipped_index
        if self.no_signal_drops is not None:
            self.wave_drop_baseline = self.no_signal_drops

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
            if work.sources:
                self._retries.appendleft(work)
            else:  # its records were revoked while it was being dispatched: their new owner has them
                self._active.pop(work.key, None)
            return
        if self.mode == "sync":
            self.wave_new -= 1
        self._requeued_new.appendleft(work)

    def _next_retry(self) -> Work | None:
        return self._retries.popleft() if self._retries else None

    def _next_new(self) -> Work | None:
        if not self._requeued_new and not self._prompts.available():
            return None  # the runner has not claimed the next prompt yet
        if self.mode == "sync":
            if self.wave_full:
                if self.in_flight > 0 or not self._released:
                    return None
                self.open_next_wave()
            if self.wave_new == 0:
                self._mark_baseline()
            self.wave_new += 1
        if self._requeued_new:
            return self._requeued_new.popleft()
        prompt = self._prompts.take()
        return Work(prompt_id=prompt.prompt_id, attempt=0, payload=prompt.payload)


@dataclass
class BackendGate:
    """Slows dispatch to one probe group at a time while the backend is down.

    Every failed group costs its prompt one of ``max_retries`` attempts. Without this, an
    engine restart of a few seconds fails every group in flight and then their immediate
    retries, and prompts are dropped for an outage that was not theirs. Once a group fails
    only with :data:`shared.errors.BACKEND_DOWN_ERRORS` the gate closes: the runner waits for the groups
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
