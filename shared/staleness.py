"""The batch window's vocabulary, pure: groups, settings, state, and the decisions with their why.

No I/O here. The rule itself is :func:`shared.window_rule.window_step`: the collector folds each
completed group through it, and ``rein replay`` reuses the same window, so a what-if answer is the
live rule. The other staleness levels are the proxy's span cap (:mod:`shared.span_cap`) and the
trainer's loss mask (:func:`services.trainer.samples.mask_nonlast_version_tokens`). Version labels
arrive normalised (``str | None``, see :mod:`shared.versions`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import SettingsConfigDict

from shared.version_window import GapStats


class Decision(enum.StrEnum):
    """What the window did with one completed group. Each group gets exactly one final decision."""

    KEPT = "kept"
    """Pending for the next batch (final once the group is in a manifest)."""
    DROPPED_STALE = "dropped_stale"
    """Outside the window when it completed."""
    DROPPED_RETROACTIVE = "dropped_retroactive"
    """Was pending; the window advanced and left it behind."""
    FAILED_RETRY = "failed_retry"
    """A session was rejected or failed; the prompt is retried whole."""
    FAILED_DROPPED = "failed_dropped"
    """Failed on its last attempt; dropped and counted per prompt."""
    DROPPED_NO_SIGNAL = "dropped_no_signal"
    """Inside the window, but every trajectory got the same reward: zero advantage, no gradient
    (only under :attr:`NoSignalGroups.DROP`). Final: the prompt is not retried."""


class StaleGroups(enum.StrEnum):
    """What the window does with a group some of whose trajectories ended outside the window."""

    DROP = "drop"
    """Drop it whole (``dropped_stale``, or ``dropped_retroactive`` once pending): a group is trained with all
    of its members or not at all, so its advantages stay computed against the whole group."""
    WITHHOLD = "withhold"
    """Keep its members inside the window and withhold the others: their rewards stay in the group's
    GRPO baseline, their tokens leave the loss. Dropped whole only when no versioned member is inside."""


class NoSignalGroups(enum.StrEnum):
    """What the window does with a completed group that carries no GRPO signal (:func:`carries_signal`)."""

    DROP = "drop"
    """Decide it ``dropped_no_signal``: batches fill with groups that have a gradient."""
    KEEP = "keep"
    """Judge it like any other group: it can fill a batch slot and train nothing."""


REWARD_TOLERANCE = 1e-9
"""Rewards closer than this are equal for :func:`carries_signal`."""


def carries_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards give GRPO a non-zero advantage: two or more that differ.

    Equal rewards (within :data:`REWARD_TOLERANCE`) centre to 0 for every trajectory, and a
    group of one trajectory is its own baseline, so neither has a gradient.
    """
    return len(rewards) >= 2 and max(rewards) - min(rewards) > REWARD_TOLERANCE




@dataclass(frozen=True)
class WindowGroup:
    """A completed group as the window judges it."""

    group_id: str
    prompt_id: str
    attempt: int
    """Failed attempts of the prompt before this one that counted toward ``max_retries``."""
    failed: bool
    versions: tuple[str, ...]
    """One end version per versioned trajectory (see :func:`trajectory_versions`)."""
    free_retries: int = 0
    """Retries of the prompt so far that did not count (failures in :data:`shared.errors.UNCHARGED_ERRORS`)."""
    uncharged: bool = False
    """Failed, and every session that did not end normally failed with an uncharged error
    (:data:`shared.errors.UNCHARGED_ERRORS`)."""
    signal: bool = True
    """Its trajectories' rewards differ (:func:`carries_signal`); ignored for a failed group. True where
    the rewards are unknown (a replay file without them)."""
    tokens: int = 0
    """Trainable tokens (loss mask 1) its trajectories generated, as far as the collector holds them."""
    members: tuple[str, ...] = ()
    """Trajectory id of each entry of ``versions`` (empty where unknown: the group can then only be judged whole)."""
    member_tokens: tuple[int, ...] = ()
    """Trainable tokens of each member (empty: unknown, counted 0)."""
    withheld: tuple[str, ...] = ()
    """Members the window withheld (:attr:`StaleGroups.WITHHOLD`): in the baseline, out of the loss."""

    def __post_init__(self) -> None:
        if self.members and len(self.members) != len(self.versions):
            raise ValueError(f"group {self.group_id}: {len(self.members)} members for {len(self.versions)} versions")
        if self.member_tokens and len(self.member_tokens) != len(self.members):
            raise ValueError(f"group {self.group_id}: {len(self.member_tokens)} token counts for "
                             f"{len(self.members)} members")

    def trained_versions(self) -> tuple[str, ...]:
        """End versions of the members not withheld (all of ``versions`` when members are unknown)."""
        if not self.withheld:
            return self.versions
        out = set(self.withheld)
        return tuple(v for m, v in zip(self.members, self.versions, strict=True) if m not in out)

    def tokens_of(self, members: Iterable[str]) -> int:
        """Trainable tokens of the given members (0 where unknown)."""
        counts = dict(zip(self.members, self.member_tokens, strict=False))
        return sum(counts.get(m, 0) for m in members)


class WindowSettings(BaseModel):
    """The batch window's settings, declared once: the collector's settings take them as a mixin
    (``REIN_KEEP_VERSIONS``, ...; every replica of a deployment must agree on them), ``rein replay`` builds
    one from its flags."""

    model_config = SettingsConfigDict(use_attribute_docstrings=True, extra="forbid")  # a mixin of CollectorSettings

    keep_versions: int = Field(default=2, ge=0)
    """Batch window: keep groups whose versions are among the newest N (by registry order); 0 turns it off."""
    batch_groups: int = Field(default=32, ge=1)
    """Groups per training batch: a manifest is emitted each time this many groups are pending."""
    max_retries: int = Field(default=2, ge=0)
    """Retries of a failed group (so max_retries + 1 attempts) before it is dropped and counted per prompt."""
    max_free_retries: int = Field(default=10, ge=0)
    """Retries that do not count toward ``max_retries``: of groups whose failed sessions all failed
    because a dependency did (engine, proxy or Kafka down, idle or lost session, incomplete group),
    not because of the prompt or the policy. Bounded so a broken setup cannot retry forever."""
    no_signal_groups: NoSignalGroups = NoSignalGroups.DROP
    """``drop``: a group whose trajectories all got the same reward (no GRPO gradient) is decided
    ``dropped_no_signal`` and not retried, so a batch is ``batch_groups`` groups that each carry signal.
    ``keep``: such groups fill batches as any other (a batch of only them trains nothing). Under
    ``drop`` a task where no group carries signal yields no batch at all; ``rein_collector_no_signal_*``
    and a ``no_signal_groups_in_a_row`` warning show it."""
    stale_groups: StaleGroups = StaleGroups.DROP
    """``drop``: a group with a trajectory that ended outside the window is dropped whole (``dropped_stale``,
    or ``dropped_retroactive`` once pending). ``withhold``: its trajectories inside the window are kept and
    the others withheld (the manifest names them): their rewards stay in the group's baseline, their tokens
    leave the loss, counted as untrained (``withheld``); dropped whole only when none is inside. Needs a
    trainer that knows manifests' ``withheld`` field (upgrade the trainer first)."""

    @field_validator("keep_versions", mode="before")
    @classmethod
    def _count_not_flag(cls, value: object) -> object:
        if isinstance(value, bool):  # pydantic would take True as 1
            raise ValueError(f"keep_versions must be an integer >= 0 (0 = off), got {value!r}")
        return value


def is_free_retry(group: WindowGroup, config: WindowSettings) -> bool:
    """A failed group's retry costs the prompt nothing: its failure was a dependency's, under the cap."""
    return group.failed and group.uncharged and group.free_retries < config.max_free_retries


def next_attempt(group: WindowGroup, config: WindowSettings) -> tuple[int, int]:
    """``(attempt, free_retries)`` of the retry of a failed group."""
    if is_free_retry(group, config):
        return group.attempt, group.free_retries + 1
    return group.attempt + 1, group.free_retries


UNTRAINED_CAUSES: dict[Decision, str] = {
    Decision.DROPPED_STALE: "window",
    Decision.DROPPED_RETROACTIVE: "window",
    Decision.DROPPED_NO_SIGNAL: "no_signal",
    Decision.FAILED_RETRY: "failed",
    Decision.FAILED_DROPPED: "failed",
}
"""Why a decision leaves a group's tokens untrained: the window left it behind, it carried no signal, or
a session was rejected or failed (a failed group's tokens are never trained, even when its prompt is retried)."""

UNTRAINED_CAUSE_NAMES: tuple[str, ...] = (*dict.fromkeys(UNTRAINED_CAUSES.values()), "withheld")
"""``window``, ``no_signal``, ``failed``, ``withheld`` (members of a kept group withheld under
:attr:`StaleGroups.WITHHOLD`): the causes, in order (each a :class:`TokenTally` field)."""


@dataclass(frozen=True)
class TokenTally:
    """Cumulative trainable tokens of decided groups (``generated``) and those left untrained, by cause.

    A group's tokens count as generated at its first decision; a kept group's count as untrained
    when a later advance drops it. So ``generated`` = untrained + tokens of groups kept (pending or batched).
    """

    generated: int = 0
    window: int = 0
    no_signal: int = 0
    failed: int = 0
    withheld: int = 0

    @property
    def untrained(self) -> int:
        return sum(self.by_cause().values())

    def by_cause(self) -> dict[str, int]:
        """``cause -> tokens`` for each of :data:`UNTRAINED_CAUSE_NAMES`."""
        return {cause: int(getattr(self, cause)) for cause in UNTRAINED_CAUSE_NAMES}

    def add(self, generated: int, decisions: Iterable[GroupDecision], withheld: int = 0) -> TokenTally:
        """This tally after one step: ``generated`` new tokens, each decision's untrained ones and
        ``withheld`` tokens of members newly withheld from kept groups."""
        by = self.by_cause()
        for d in decisions:
            cause = UNTRAINED_CAUSES.get(d.decision)
            if cause is not None:
                by[cause] += d.tokens
        by["withheld"] += withheld
        return TokenTally(self.generated + generated, **by)


@dataclass(frozen=True)
class WindowState:
    """Everything the window remembers between groups (lives in Redis for the collector)."""

    current: str | None = None
    pending: tuple[WindowGroup, ...] = ()
    batches: int = 0
    dropped_since_batch: tuple[tuple[str, str], ...] = ()
    """(group id, decision) of drops since the last manifest."""
    drops_total: int = 0
    no_signal_run: int = 0
    """Non-failed groups without signal in a row (any decision); 0 after one with signal."""
    tokens: TokenTally = field(default_factory=TokenTally)


@dataclass(frozen=True)
class WindowSnapshot:
    keep_versions: int
    current_version: str | None
    current_index: int | None
    cutoff_index: int | None


@dataclass(frozen=True)
class GroupDecision:
    group_id: str
    prompt_id: str
    attempt: int
    decision: Decision
    window: WindowSnapshot
    versions: tuple[str, ...]
    tokens: int = 0
    """The group's trainable tokens (:attr:`WindowGroup.tokens`); of a retroactive drop, less those of
    members already withheld (counted then)."""
    withheld: tuple[str, ...] = ()
    """Of a kept group: its members withheld (:attr:`StaleGroups.WITHHOLD`)."""


@dataclass(frozen=True)
class Batch:
    """Groups taken for one training step, with the window state and drops since the last batch."""

    index: int
    groups: tuple[WindowGroup, ...]
    window: WindowSnapshot
    gap: GapStats | None
    dropped: tuple[tuple[str, str], ...]
    drops_total: int
    tokens: TokenTally = field(default_factory=TokenTally)
    """The window's token tally once this batch was taken."""


@dataclass(frozen=True)
class StepResult:
    state: WindowState
    decisions: tuple[GroupDecision, ...]
    batch: Batch | None = None
    advanced: bool = False
