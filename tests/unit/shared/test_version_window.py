"""The version window's arithmetic (``shared/version_window.py``): the version a trajectory ends on (its
highest versioned segment decides, the later record on a tie), the cutoff of the newest ``keep_versions``
versions and whether a group falls before it, and the version gaps a batch reports."""

from __future__ import annotations

import pytest

from shared.staleness import WindowSettings
from shared.version_window import (
    SegmentEnd,
    cutoff_index,
    is_stale,
    trajectory_versions,
    version_gaps,
)


def test_highest_segment_decides() -> None:
    samples = [SegmentEnd("t1", 1, "v3"), SegmentEnd("t1", 0, "v1"), SegmentEnd("t2", 0, "v2")]
    assert trajectory_versions(samples) == {"t1": "v3", "t2": "v2"}


def test_segment_tie_goes_to_the_later_record() -> None:
    samples = [SegmentEnd("t1", 2, "v1"), SegmentEnd("t1", 2, "v2")]
    assert trajectory_versions(samples) == {"t1": "v2"}


def test_unversioned_samples_and_missing_ids_are_ignored() -> None:
    samples = [
        SegmentEnd("t1", 0, None),
        SegmentEnd(None, 0, "v1"),
        SegmentEnd("", 3, "v1"),
        SegmentEnd("t2", 0, "v1"),
    ]
    assert trajectory_versions(samples) == {"t2": "v1"}


def test_unversioned_higher_segment_does_not_hide_lower_versioned_one() -> None:
    assert trajectory_versions([SegmentEnd("t", 0, "v1"), SegmentEnd("t", 1, None)]) == {"t": "v1"}


def test_keep_versions_zero_is_off_and_negative_rejected() -> None:
    assert WindowSettings(keep_versions=0).keep_versions == 0
    assert cutoff_index(10, 0) is None
    assert not is_stale([0], 10, 0)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        WindowSettings(keep_versions=-1)
    with pytest.raises(ValueError, match="integer"):
        WindowSettings(keep_versions=True)


def test_one_stale_trajectory_drops_whole_group() -> None:
    assert is_stale([5, 5, 3], current_index=5, keep_versions=2)
    assert not is_stale([5, 4, 4], current_index=5, keep_versions=2)


def test_gap_stats() -> None:
    gap = version_gaps(5, [5, 4, 3])
    assert gap is not None and (gap.min, gap.max, gap.mean, gap.count) == (0, 2, 1.0, 3)
    assert version_gaps(None, [1]) is None
    assert version_gaps(3, []) is None
