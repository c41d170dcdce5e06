"""The batch window's rule, pure: fold one completed group into the window (:func:`window_step`).

The only copy of the rule: the collector runs it against the state in Redis, ``rein replay`` and
the in-process bench through :class:`WindowReplay`. Its types are :mod:`shared.staleness`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shared.staleness import (
    Batch,
    Decision,
    GroupDecision,
    NoSignalGroups,
    StaleGroups,
    StepResult,
    WindowGroup,
    WindowSettings,
    WindowSnapshot,
    WindowState,
    is_free_retry,
)
from shared.version_window import cutoff_index, is_stale, version_gaps

IndexOf = Callable[[str], int]


def _snapshot(state_current: str | None, index_of: IndexOf, keep: int) -> WindowSnapshot:
    current_index = index_of(state_current) if state_current is not None else None
    return WindowSnapshot(keep, state_current, current_index, cutoff_index(current_index, keep))


def stale_members(group: WindowGroup, cutoff: int | None, index_of: IndexOf) -> tuple[str, ...]:
    """Members whose end version is below ``cutoff`` (none when the window is off or members are unknown)."""
    if cutoff is None or not group.members:
        return ()
    return tuple(m for m, v in zip(group.members, group.versions, strict=True) if index_of(v) < cutoff)


def _judge_stale(
    group: WindowGroup, snap: WindowSnapshot, index_of: IndexOf, config: WindowSettings
) -> WindowGroup | None:
    """A group as the window keeps it, or None to drop it whole.

    Inside the window: unchanged. Outside, under :attr:`StaleGroups.WITHHOLD`, with at least one
    member inside: its members outside are withheld (added to those withheld before). Else None.
    """
    if not is_stale((index_of(v) for v in group.versions), snap.current_index, snap.keep_versions):
        return group
    if config.stale_groups is not StaleGroups.WITHHOLD:
        return None
    stale = stale_members(group, snap.cutoff_index, index_of)
    if not group.members or len(stale) == len(group.members):
        return None
    return replace(group, withheld=tuple(dict.fromkeys((*group.withheld, *stale))))


def window_step(state: WindowState, group: WindowGroup, index_of: IndexOf, config: WindowSettings) -> StepResult:
    """Fold one completed group into the window.

    Order: observe the group's versions -> if the window advanced, remove
    pending groups now outside it -> judge the new group -> take a batch when
    enough groups are pending. A failed group is judged before it is observed and
    never moves the window (a group that will not be trained must not make others stale). A group
    without signal is observed
    like any other (it is evidence of the newest version); judged, staleness comes
    first (a stale group without signal is ``dropped_stale``), then, under
    :attr:`NoSignalGroups.DROP`, it is ``dropped_no_signal``. Under :attr:`StaleGroups.WITHHOLD`
    a group outside the window with a member inside is kept with its other members withheld,
    on arrival and when an advance leaves a pending group's members behind (no new decision:
    the group stays ``kept``). ``index_of`` gives registry order for every label in
    ``group.versions`` and in pending groups. The state's :class:`TokenTally` counts the group's
    tokens as generated, every drop's and every newly withheld member's as untrained.
    """
    keep = config.keep_versions
    decisions: list[GroupDecision] = []
    dropped = list(state.dropped_since_batch)
    drops_total = state.drops_total
    current = state.current
    pending = list(state.pending)
    advanced = False
    withheld_tokens = 0

    if group.failed:
        final = group.attempt >= config.max_retries and not is_free_retry(group, config)
        kind = Decision.FAILED_DROPPED if final else Decision.FAILED_RETRY
        snap = _snapshot(current, index_of, keep)
        decisions.append(
            GroupDecision(group.group_id, group.prompt_id, group.attempt, kind, snap, group.versions, group.tokens)
        )
        if final:
            dropped.append((group.group_id, kind.value))
            drops_total += 1
        tokens = state.tokens.add(group.tokens, decisions)
        new_state = replace(state, dropped_since_batch=tuple(dropped), drops_total=drops_total, tokens=tokens)
        return StepResult(new_state, tuple(decisions))

    if group.versions:
        newest = max(group.versions, key=index_of)
        if current is None or index_of(newest) > index_of(current):
            current = newest
            advanced = True
    snap = _snapshot(current, index_of, keep)

    if advanced and pending:
        still: list[WindowGroup] = []
        for held in pending:
            judged = _judge_stale(held, snap, index_of, config)
            if judged is None:
                left = held.tokens - held.tokens_of(held.withheld)  # withheld members were counted then
                decisions.append(
                    GroupDecision(
                        held.group_id, held.prompt_id, held.attempt, Decision.DROPPED_RETROACTIVE, snap, held.versions,
                        left,
                    )
                )
                dropped.append((held.group_id, Decision.DROPPED_RETROACTIVE.value))
                drops_total += 1
            else:
                withheld_tokens += judged.tokens_of(m for m in judged.withheld if m not in held.withheld)
                still.append(judged)
        pending = still

    judged = _judge_stale(group, snap, index_of, config)
    withheld: tuple[str, ...] = ()
    if judged is None:
        kind = Decision.DROPPED_STALE
        dropped.append((group.group_id, kind.value))
        drops_total += 1
    elif not group.signal and config.no_signal_groups is NoSignalGroups.DROP:
        kind = Decision.DROPPED_NO_SIGNAL
        dropped.append((group.group_id, kind.value))
        drops_total += 1
    else:
        kind = Decision.KEPT
        pending.append(judged)
        withheld = judged.withheld
        withheld_tokens += judged.tokens_of(withheld)
    decisions.append(
        GroupDecision(
            group.group_id, group.prompt_id, group.attempt, kind, snap, group.versions, group.tokens, withheld
        )
    )
    tokens = state.tokens.add(group.tokens, decisions, withheld_tokens)

    batch: Batch | None = None
    batches = state.batches
    if len(pending) >= config.batch_groups:
        taken, pending = tuple(pending[: config.batch_groups]), pending[config.batch_groups :]
        gap = version_gaps(snap.current_index, (index_of(v) for g in taken for v in g.trained_versions()))
        batch = Batch(batches, taken, snap, gap, tuple(dropped), drops_total, tokens)
        batches += 1
        dropped = []

    no_signal_run = 0 if group.signal else state.no_signal_run + 1
    new_state = WindowState(current, tuple(pending), batches, tuple(dropped), drops_total, no_signal_run, tokens)
    return StepResult(new_state, tuple(decisions), batch, advanced)


@dataclass
class WindowReplay:
    """Folds a recorded stream through the window in memory (``rein replay``, tests)."""

    config: WindowSettings
    index_of: IndexOf
    state: WindowState = field(default_factory=WindowState)

    def feed(self, group: WindowGroup) -> StepResult:
        result = window_step(self.state, group, self.index_of, self.config)
        self.state = result.state
        return result
