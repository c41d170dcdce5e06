"""The async runner's admission bound (services/rollout/pacing.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.pacing import Pacer


def _pacer(*, started: int = 0, drops: int = 0, keep: int | None = 2, groups: int | None = 4,
           consumed: int | None = None, enabled: bool = True) -> Pacer:
    pacer = Pacer(enabled=enabled)
    pacer.on_window(started=started, drops=drops, keep_versions=keep, batch_groups=groups)
    pacer.on_consumed(consumed)
    return pacer


def test_capacity_is_keep_versions_batches() -> None:
    assert _pacer(keep=2, groups=4).capacity == 8
    assert _pacer(keep=3, groups=1).capacity == 3


def test_the_bound_is_off_without_window_settings_with_no_window_or_when_disabled() -> None:
    assert _pacer(keep=None, groups=None, started=1000).admits()
    assert _pacer(keep=0, groups=4, started=1000).capacity is None
    assert _pacer(keep=0, groups=4, started=1000).admits()
    assert _pacer(enabled=False, started=1000).admits()


def test_live_prompts_are_started_minus_dropped_minus_trained() -> None:
    assert _pacer(started=10, drops=1, groups=4, consumed=0).live == 5  # batch 0 took 4
    assert _pacer(started=10, drops=1, groups=4, consumed=None).live == 9  # nothing trained yet
    assert _pacer(started=3, drops=0, groups=4, consumed=1).live == 0  # never negative


def test_a_prompt_starts_only_below_capacity() -> None:
    assert _pacer(started=7, keep=2, groups=4).admits()
    assert not _pacer(started=8, keep=2, groups=4).admits()
    assert _pacer(started=8, drops=1, keep=2, groups=4).admits()  # a drop frees its place
    assert _pacer(started=8, keep=2, groups=4, consumed=0).admits()  # a consumed batch frees B places
    assert not _pacer(started=12, keep=2, groups=4, consumed=0).admits()


def test_readings_never_go_back() -> None:
    pacer = _pacer(started=8, drops=2, consumed=3)
    pacer.on_window(started=5, drops=1, keep_versions=2, batch_groups=4)  # an older reading
    pacer.on_consumed(1)
    pacer.on_consumed(None)
    assert (pacer.started, pacer.drops, pacer.consumed_index) == (8, 2, 3)
    pacer.on_claimed(9)
    assert pacer.started == 9


@settings(max_examples=300, deadline=None)
@given(
    keep=st.integers(1, 3),
    groups=st.integers(1, 4),
    actions=st.lists(st.sampled_from(["start", "drop", "train", "read"]), max_size=120),
    data=st.data(),
)
def test_a_started_prompt_is_trained_inside_the_window(
    keep: int, groups: int, actions: list[str], data: st.DataObject
) -> None:
    """A runner that starts only while ``admits()``, a collector that batches live prompts oldest first
    (or drops some for good), a trainer that consumes whole batches: a prompt started while the trainer
    had consumed ``T`` batches is trained in a batch no later than ``T + keep - 1``, and live prompts
    never exceed the capacity. The pacer sees drops only when it reads Redis (``read``), as the runner."""
    pacer = _pacer(keep=keep, groups=groups)
    live: list[tuple[int, int]] = []  # (prompt, batches consumed when it started), oldest first
    started = drops = consumed = 0
    for action in actions:
        if action == "start" and pacer.admits():
            started += 1
            pacer.on_claimed(started)
            live.append((started, consumed))
        elif action == "drop" and live:
            live.pop(data.draw(st.integers(0, len(live) - 1)))
            drops += 1
        elif action == "train" and len(live) >= groups:
            batch, live = live[:groups], live[groups:]
            for _prompt, at_start in batch:
                assert consumed <= at_start + keep - 1
            pacer.on_consumed(consumed)
            consumed += 1
        elif action == "read":
            pacer.on_window(started=started, drops=drops, keep_versions=keep, batch_groups=groups)
        assert len(live) <= keep * groups
        assert pacer.live >= len(live)  # drops not yet read make the pacer conservative, never lax
