"""The version window's arithmetic, pure: which weight versions a trajectory ends on, and which are in the window.

A batch window keeps the newest ``keep_versions`` versions (by registry index): :func:`cutoff_index` is the
oldest index kept, :func:`is_stale` says whether a trajectory's versions fall before it, and
:func:`version_gaps` measures how far behind the current version a batch's trajectories are. The
collector's window (:mod:`shared.staleness`), ``rein status`` and ``rein replay`` read it here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SegmentEnd:
    """One sample of a group as the window sees it: which trajectory, which segment, which end version."""

    trajectory_id: str | None
    segment_index: int
    end_version: str | None
    tokens: int = 0
    """Trainable tokens (loss mask 1) of the segment: what withholding its trajectory leaves untrained."""


def trajectory_versions(samples: Sequence[SegmentEnd]) -> dict[str, str]:
    """Trajectory id -> end version of its highest segment (ties: the later sample).

    Samples without a trajectory id or without a real end version are ignored, so
    unversioned samples never make a group stale. Insertion order is first-seen.
    """
    best: dict[str, tuple[int, int, str]] = {}
    for position, sample in enumerate(samples):
        version = sample.end_version
        if version is None or sample.trajectory_id is None or sample.trajectory_id == "":
            continue
        key = str(sample.trajectory_id)
        rank = (int(sample.segment_index), position)
        held = best.get(key)
        if held is None or rank >= held[:2]:
            best[key] = (rank[0], rank[1], version)
    return {key: value[2] for key, value in best.items()}


def trajectory_tokens(samples: Sequence[SegmentEnd]) -> dict[str, int]:
    """Trajectory id -> trainable tokens over all of its segments (samples without an id are ignored)."""
    out: dict[str, int] = {}
    for sample in samples:
        if sample.trajectory_id is not None and sample.trajectory_id != "":
            key = str(sample.trajectory_id)
            out[key] = out.get(key, 0) + int(sample.tokens)
    return out


def cutoff_index(current_index: int | None, keep_versions: int) -> int | None:
    """Lowest index still inside the window; None when off or nothing observed."""
    if keep_versions == 0 or current_index is None:
        return None
    return max(0, current_index - keep_versions + 1)


def is_stale(version_indices: Iterable[int], current_index: int | None, keep_versions: int) -> bool:
    """A group is stale when any trajectory's version index is below the cutoff."""
    cutoff = cutoff_index(current_index, keep_versions)
    if cutoff is None:
        return False
    return any(index < cutoff for index in version_indices)


@dataclass(frozen=True)
class GapStats:
    """Version gap (current index - trajectory's version index) over trajectories."""

    min: int
    max: int
    mean: float
    count: int


def version_gaps(current_index: int | None, version_indices: Iterable[int]) -> GapStats | None:
    """min/max/mean gap, or None when there is no current version or no versioned trajectory."""
    if current_index is None:
        return None
    gaps = [current_index - index for index in version_indices]
    if not gaps:
        return None
    return GapStats(min(gaps), max(gaps), sum(gaps) / len(gaps), len(gaps))
