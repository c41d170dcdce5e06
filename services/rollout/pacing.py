"""The admission bound of an async runner: start a prompt only while it can still be trained in the window.

Pure (no I/O, no clock); the runner feeds it what it reads from Redis and the ``weights`` topic.

Without a bound the engine generates as fast as it can while the trainer takes a batch at a time:
groups pile up in the collector and in the batches topic, are trained many versions after they
were generated, or are dropped by the window, and the generation was waste (on SmolLM2 an unpaced
async run generated 4.3x the tokens of a sync run, docs/benchmarks.md). The bound is AReaL's admission
rule in rein's terms: with ``B`` groups per batch and a window of ``keep_versions`` versions, a
prompt started now, while the trainer has consumed ``T`` batches, joins a batch at most
``keep_versions - 1`` batches after the next one only if fewer than ``keep_versions * B`` prompts
are *live* — started and neither trained nor finally dropped:

    live = started - drops - B * T

``started`` is the shared prompt cursor (every runner of the stream claims from it), ``drops`` the
window's final drops (stale, retroactive, failed on the last attempt, no signal: their prompt leaves
the run untrained), ``T`` the batches the trainer has consumed as of the weights the engines hold (the newest
``WeightApplied``'s ``last_index``, or a ``BatchSkipped``, + 1). Retries are not paced: their prompt is
live already, and the trainer's next batch may need them.

The bound is off while the collector has not published its window settings (nothing to pace
against) and with ``keep_versions`` 0 (no window: no staleness bound either).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pacer:
    """The runner's view of the live prompts; :meth:`admits` decides whether one more may start."""

    enabled: bool = True
    started: int = 0
    """Prompts claimed from the stream's cursor, by every runner (never decreases)."""
    drops: int = 0
    """Groups the window dropped for good (``drops_total``)."""
    keep_versions: int | None = None
    batch_groups: int | None = None
    """The collector's window settings (``window_config``); None until a collector published them."""
    consumed_index: int = -1
    """Highest manifest index the held weights have consumed (trained, or skipped without gradient)."""

    def on_window(self, *, started: int, drops: int, keep_versions: int | None, batch_groups: int | None) -> None:
        """What Redis holds now; counters never go back (a reading older than one already seen changes nothing)."""
        self.started = max(self.started, started)
        self.drops = max(self.drops, drops)
        self.keep_versions, self.batch_groups = keep_versions, batch_groups

    def on_claimed(self, cursor: int) -> None:
        """This runner claimed prompt number ``cursor`` (the cursor's value after the claim)."""
        self.started = max(self.started, cursor)

    def on_consumed(self, index: int | None) -> None:
        """Weights that consumed manifests up to ``index`` were applied, or the trainer skipped ``index``."""
        if index is not None:
            self.consumed_index = max(self.consumed_index, index)

    @property
    def capacity(self) -> int | None:
        """Most live prompts, or None when the bound is off."""
        if not self.enabled or not self.keep_versions or not self.batch_groups:
            return None
        return self.keep_versions * self.batch_groups

    @property
    def live(self) -> int:
        """Prompts started and not yet trained or dropped (0 when the window settings are unknown)."""
        if not self.batch_groups:
            return 0
        return max(0, self.started - self.drops - self.batch_groups * (self.consumed_index + 1))

    def admits(self) -> bool:
        """One more prompt may start."""
        capacity = self.capacity
        return capacity is None or self.live < capacity
