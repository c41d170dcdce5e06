"""CompletedGroup -> training samples, pure (no I/O, no torch).

One sample per trajectory segment. Its loss mask is the segment's mask with the
first token switched off (position 0 has no prefix to predict it from) and, when
``mask_nonlast_version`` is on, :func:`shared.staleness.mask_nonlast_version_tokens`
applied (token-level staleness control: only the tokens of a sample's last version are trained); tokens sampled
greedily are switched off too (a deterministic choice has no probability to move). Rewards
live on trajectories: every segment of a trajectory carries its reward, and the
GRPO baseline is taken over the trajectories of a group (not over segments, so a
trajectory cut into several segments does not weigh more in its group's mean).

A trajectory the window withheld (``REIN_STALE_GROUPS=withhold``: it ended outside the window
while others of its group did not) keeps its reward in the group's baseline and gives no sample.

The collector drops groups with rejected or failed sessions, but this module does
not rely on that: such trajectories, malformed segments and segments with no
trainable token are skipped and counted.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from shared.schemas import CompletedGroup, SamplingParams, Segment


def mask_nonlast_version_tokens(loss_mask: Sequence[int], versions: Sequence[str | None]) -> list[int]:
    """Keep only trainable tokens of the version of the last trainable real token.

    With zero or one distinct real version among trainable tokens (mask 1) the mask
    is returned unchanged (unknown-version tokens stay trained). With two or more,
    a token stays 1 only if it was 1, its version is real and equals the version of
    the last trainable real token in sequence order, so ``A,B,A`` keeps both ``A``
    runs. Never turns a 0 into a 1; idempotent.
    """
    if len(loss_mask) != len(versions):
        raise ValueError(f"loss_mask has {len(loss_mask)} entries but versions has {len(versions)}")
    trainable = [v if m else None for m, v in zip(loss_mask, versions, strict=True)]
    real = [v for v in trainable if v is not None]
    if len(set(real)) < 2:
        return [1 if m else 0 for m in loss_mask]
    last = real[-1]
    return [1 if v == last else 0 for v in trainable]


TRAINABLE_STATUSES = frozenset({"completed", "truncated"})


@dataclass(frozen=True)
class Sample:
    """One segment ready for the loss; every list has one entry per token."""

    token_ids: list[int]
    loss_mask: list[int]
    """1 = this token is trained (an output token of the sampled version kept by the version mask)."""
    rollout_logprobs: list[float]
    """The engine's logprob of each token when it was sampled (0.0 on context tokens)."""
    trajectory: int
    """Position of the sample's trajectory in :attr:`BatchSamples.rewards`."""
    segment_index: int
    session_id: str
    versions: tuple[str | None, ...] = ()
    """Weight version that sampled each token (None on context tokens; empty: not known)."""
    sampling: tuple[SamplingParams | None, ...] = ()
    """Sampling parameters of each token (None on context tokens and where none were recorded;
    empty: none recorded): the trainer scores a token under the distribution it was drawn from."""


@dataclass
class BatchSamples:
    """Samples of one manifest plus the per-trajectory rewards and the bookkeeping counters."""

    samples: list[Sample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Reward of each kept trajectory."""
    trajectory_group: list[int] = field(default_factory=list)
    """Group position (0..groups-1) of each kept trajectory: the GRPO baseline is per group."""
    groups: int = 0
    trainable_tokens: int = 0
    """Tokens with mask 1 (after dropping position 0), before the version mask."""
    version_masked_tokens: int = 0
    """Tokens the version mask switched off."""
    skipped_trajectories: int = 0
    """Trajectories not trained because their status was rejected/failed."""
    skipped_segments: int = 0
    """Segments without a single trainable token (after the version mask)."""
    malformed_segments: int = 0
    """Segments whose lists disagree in length or whose mask is not 0/1."""
    truncated_segments: int = 0
    """Segments cut to the policy's context window."""
    greedy_tokens: int = 0
    """Output tokens sampled greedily (temperature 0): a deterministic choice has no probability to
    improve, so they are never trained."""
    degenerate_groups: int = 0
    """Groups whose kept trajectories all have the same reward (zero advantage: nothing learned)."""
    withheld_trajectories: int = 0
    """Trajectories the window withheld: in their group's baseline, not in the loss (their tokens are
    in the window's tally, cause ``withheld``)."""

    @property
    def masked_token_fraction(self) -> float:
        """Share of trainable tokens removed by the version mask (0 when nothing was trainable)."""
        return self.version_masked_tokens / self.trainable_tokens if self.trainable_tokens else 0.0

    @property
    def trained_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.samples)


def _well_formed(seg: Segment) -> bool:
    n = len(seg.token_ids)
    return (
        n == len(seg.loss_mask) == len(seg.logprobs) == len(seg.versions)
        and all(m in (0, 1) for m in seg.loss_mask)
    )


def build_samples(
    groups: Sequence[CompletedGroup],
    *,
    mask_nonlast_version: bool = True,
    max_tokens: int | None = None,
    withheld: Collection[str] = frozenset(),
) -> BatchSamples:
    """Samples of ``groups`` in order (group, trajectory, segment index).

    ``max_tokens`` (the policy's context window) cuts longer segments from the end,
    before the version mask is taken, as the reference does. ``withheld``: session ids of
    trajectories whose reward counts in the baseline but whose tokens are not trained.
    """
    out = BatchSamples()
    for group in groups:
        group_pos = out.groups
        out.groups += 1
        group_rewards: list[float] = []
        for traj in group.trajectories:
            if traj.status not in TRAINABLE_STATUSES:
                out.skipped_trajectories += 1
                continue
            traj_pos = len(out.rewards)
            out.rewards.append(float(traj.reward))
            out.trajectory_group.append(group_pos)
            group_rewards.append(float(traj.reward))
            if traj.session_id in withheld:
                out.withheld_trajectories += 1
                continue
            for seg in sorted(traj.segments, key=lambda s: s.segment_index):
                sample = _segment_sample(seg, traj_pos, traj.session_id, mask_nonlast_version, max_tokens, out)
                if sample is not None:
                    out.samples.append(sample)
        if group_rewards and max(group_rewards) == min(group_rewards):
            out.degenerate_groups += 1
    return out


def _segment_sample(
    seg: Segment,
    traj_pos: int,
    session_id: str,
    mask_nonlast_version: bool,
    max_tokens: int | None,
    out: BatchSamples,
) -> Sample | None:
    if not _well_formed(seg):
        out.malformed_segments += 1
        return None
    ids, mask, logprobs, versions = list(seg.token_ids), list(seg.loss_mask), list(seg.logprobs), list(seg.versions)
    sampling = seg.token_sampling()
    if max_tokens is not None and len(ids) > max_tokens:
        cut = max_tokens
        ids, mask, logprobs, versions, sampling = ids[:cut], mask[:cut], logprobs[:cut], versions[:cut], sampling[:cut]
        out.truncated_segments += 1
    if mask:
        mask[0] = 0  # nothing predicts the first token
    greedy = [i for i, p in enumerate(sampling) if mask[i] and p is not None and p.temperature == 0]
    for i in greedy:
        mask[i] = 0
    out.greedy_tokens += len(greedy)
    before = sum(mask)
    if mask_nonlast_version:
        mask = mask_nonlast_version_tokens(mask, versions)
    after = sum(mask)
    out.trainable_tokens += before
    out.version_masked_tokens += before - after
    if after == 0:
        out.skipped_segments += 1
        return None
    return Sample(
        token_ids=ids,
        loss_mask=mask,
        rollout_logprobs=[float(x) for x in logprobs],
        trajectory=traj_pos,
        segment_index=seg.segment_index,
        session_id=session_id,
        versions=tuple(versions),
        sampling=tuple(sampling) if seg.sampling else (),
    )
