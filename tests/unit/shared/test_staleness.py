"""The batch window's vocabulary (``shared/staleness.py``): which rewards carry a signal (GRPO learns
nothing from a group whose rewards are all equal), the no-signal policy taken by name, and the empty state
a window starts from."""

from __future__ import annotations

import pytest

from shared.staleness import NoSignalGroups, WindowSettings, WindowState, carries_signal


def test_state_default_is_empty() -> None:
    assert WindowState().current is None and WindowState().pending == ()


@pytest.mark.parametrize(
    ("rewards", "signal"),
    [
        ([], False),
        ([1.0], False),  # its own baseline
        ([1.0, 1.0, 1.0], False),
        ([0.0, 0.0], False),
        ([0.3, 0.3 + 1e-12], False),  # equal within the tolerance
        ([0.0, 1.0], True),
        ([1.0, 1.0, 0.5], True),
        ([-1.0, -1.0 + 1e-6], True),
    ],
)
def test_carries_signal(rewards: list[float], signal: bool) -> None:
    assert carries_signal(rewards) is signal


def test_config_takes_the_policy_by_name_and_refuses_others() -> None:
    keep = WindowSettings(keep_versions=1, batch_groups=1, no_signal_groups="keep")  # type: ignore[arg-type]
    assert keep.no_signal_groups is NoSignalGroups.KEEP
    assert WindowSettings(keep_versions=1, batch_groups=1).no_signal_groups is NoSignalGroups.DROP
    with pytest.raises(ValueError, match="no_signal_groups"):
        WindowSettings(keep_versions=1, batch_groups=1, no_signal_groups="sometimes")  # type: ignore[arg-type]
