"""The window's view of a completed group, pure: what :func:`shared.window_rule.window_step` judges.

A ``rollout.groups`` record carries every token's version; the window only needs one end
version per trajectory (the last trainable, versioned token of its highest segment),
whether a failure is charged to the prompt, whether the rewards differ (GRPO signal), and how
many trainable tokens it generated (what its drop leaves untrained).
The live collector and the what-if replay (``ops/replay.py``) both build that view here, so
the live and the replayed rule cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from shared.errors import UNCHARGED_ERRORS
from shared.schemas import CompletedGroup
from shared.staleness import WindowGroup, carries_signal
from shared.version_window import SegmentEnd, trajectory_tokens, trajectory_versions


def segment_end_version(loss_mask: Sequence[int], versions: Sequence[str | None]) -> str | None:
    """Version of the segment's last trainable (mask 1) token with a real version, else None."""
    for mask, version in zip(reversed(loss_mask), reversed(versions), strict=True):
        if mask and version is not None:
            return version
    return None


def segment_ends(group: CompletedGroup) -> list[SegmentEnd]:
    """One :class:`SegmentEnd` per segment of every trajectory (trajectory id = session id)."""
    return [
        SegmentEnd(
            traj.session_id, seg.segment_index, segment_end_version(seg.loss_mask, seg.versions),
            seg.loss_mask.count(1),
        )
        for traj in group.trajectories
        for seg in traj.segments
    ]


def group_rewards(group: CompletedGroup) -> list[float]:
    """Each trajectory's reward (a failed group's are never judged)."""
    return [traj.reward for traj in group.trajectories]


def window_group_from_samples(
    group_id: str,
    prompt_id: str,
    attempt: int,
    failed: bool,
    samples: Sequence[SegmentEnd],
    rewards: Sequence[float] | None = None,
) -> WindowGroup:
    """The window's view of a group: one end version per versioned trajectory (highest segment decides),
    the trajectory ids as members, and the samples' trainable tokens, per member and in all.

    ``rewards`` are the trajectories' rewards; None (unknown) counts as signal.
    """
    ends = trajectory_versions(samples)
    per_trajectory = trajectory_tokens(samples)
    signal = rewards is None or carries_signal(rewards)
    return WindowGroup(
        group_id, prompt_id, attempt, failed, tuple(ends.values()), signal=signal,
        tokens=sum(int(s.tokens) for s in samples), members=tuple(ends),
        member_tokens=tuple(per_trajectory.get(m, 0) for m in ends),
    )


def trainable_tokens(group: CompletedGroup) -> int:
    """Tokens with loss mask 1 over every segment of every trajectory (a failed group: those it holds)."""
    return sum(seg.loss_mask.count(1) for traj in group.trajectories for seg in traj.segments)


def window_group(group: CompletedGroup) -> WindowGroup:
    """The window's view of a completed group from ``rollout.groups``."""
    view = window_group_from_samples(
        group.group_id, group.prompt_id, group.attempt, group.failed, segment_ends(group), group_rewards(group)
    )
    abnormal = [t.error for t in group.trajectories if t.status not in ("completed", "truncated")]
    uncharged = group.failed and bool(abnormal) and all(e in UNCHARGED_ERRORS for e in abnormal)
    return replace(view, free_retries=group.free_retries, uncharged=uncharged)
