"""The broadcaster's pure decisions."""

from __future__ import annotations

import pytest

from services.weight_broadcaster.decide import (
    EventAction,
    PauseAction,
    PauseAnswer,
    after_pause,
    backoff_s,
    classify,
    not_served,
    plan_events,
    renew_before_update,
    update_targets,
)
from shared.schemas import WeightPublished


def ev(seq: int, digest: str = "") -> WeightPublished:
    return WeightPublished(version=f"v{seq}", seq=seq, path=f"/w/v{seq}.pt", digest=digest or f"d{seq}", step=seq)


def test_plan_registers_all_in_order_and_applies_the_newest() -> None:
    plan = plan_events([ev(3), ev(1), ev(2), ev(3)])
    assert [e.seq for e in plan.register] == [1, 2, 3]
    assert plan.apply is not None and plan.apply.seq == 3
    assert [e.seq for e in plan.superseded] == [1, 2]
    assert plan_events([]).apply is None


V2 = ("v2", "d2")


@pytest.mark.parametrize(
    ("seq", "applied", "engines", "action"),
    [
        (2, None, [("v0", "d0")], EventAction.APPLY),
        (2, 1, [("v1", "d1"), ("v1", "d1")], EventAction.APPLY),
        (1, 2, [V2], EventAction.OLDER),  # late replay of an older version: never roll back
        (2, 2, [V2, V2], EventAction.ALREADY_APPLIED),  # replay after a crash
        (2, 2, [V2, ("v1", "d1")], EventAction.APPLY),  # one engine lags (restarted): load it again
        (2, None, [V2, (None, None)], EventAction.APPLY),  # an engine did not answer: cannot know
        (2, 1, [("v1", "d2")], EventAction.APPLY),  # same weights (no-op step), new label still loaded
        (2, 2, [("v2", None), V2], EventAction.ALREADY_APPLIED),  # SGLang reports no digest: the label says
        (2, 2, [("v2", "d9")], EventAction.APPLY),  # a digest that is reported must match
        (2, None, [("default", None)], EventAction.APPLY),  # SGLang's label before any update
    ],
)
def test_classify(
    seq: int, applied: int | None, engines: list[tuple[str | None, str | None]], action: EventAction
) -> None:
    assert classify(ev(seq), applied, engines) is action


Q = PauseAnswer("http://p1", ok=True, quiesced=True)
NOT_Q = PauseAnswer("http://p2", ok=True, quiesced=False)
FAILED = PauseAnswer("http://p3", ok=False, quiesced=False, error="connect refused")


@pytest.mark.parametrize(
    ("answers", "attempt", "action", "bad"),
    [
        ([Q], 1, PauseAction.UPDATE, []),
        ([], 1, PauseAction.UPDATE, []),  # no proxies configured: engines only
        ([Q, NOT_Q], 1, PauseAction.RETRY, ["http://p2"]),
        ([Q, FAILED], 2, PauseAction.RETRY, ["http://p3"]),
        ([NOT_Q, FAILED], 3, PauseAction.GIVE_UP, ["http://p2", "http://p3"]),
        ([Q], 3, PauseAction.UPDATE, []),  # last attempt still updates when all quiesced
    ],
)
def test_after_pause(answers: list[PauseAnswer], attempt: int, action: PauseAction, bad: list[str]) -> None:
    decision = after_pause(answers, attempt, max_attempts=3)
    assert decision.action is action
    assert decision.unquiesced == bad


def test_after_pause_rejects_nonsense_attempts() -> None:
    with pytest.raises(ValueError, match="attempt"):
        after_pause([Q], 0, 3)


@pytest.mark.parametrize(("attempt", "expected"), [(1, 0.5), (2, 1.0), (3, 2.0), (6, 10.0)])
def test_backoff(attempt: int, expected: float) -> None:
    assert backoff_s(attempt, 0.5, 10.0) == expected


@pytest.mark.parametrize(
    ("version", "digest", "reason"),
    [
        ("v1", "d1", ""),
        ("v1", None, ""),  # SGLang: no digest, the label is the proof
        ("v1", "x", "digest x"),
        ("v0", "d1", "weight_version 'v0'"),
        (None, None, "weight_version None"),
    ],
)
def test_not_served(version: str | None, digest: str | None, reason: str) -> None:
    got = not_served(ev(1), version, digest)
    assert (got == "") if not reason else (reason in got)


def test_a_renewal_before_the_update_only_after_a_third_of_the_lease() -> None:
    assert not renew_before_update(0.05, 30.0)
    assert not renew_before_update(10.0, 30.0)
    assert renew_before_update(10.01, 30.0)
    assert renew_before_update(1e-6, 1e-6)


def test_update_targets_keep_every_fixed_engine_and_the_registered_ones_that_answer() -> None:
    answered = [("http://f1", False), ("http://f2", True), ("http://r1", True), ("http://r2", False)]
    assert update_targets(answered, ["http://f1", "http://f2"]) == (
        ["http://f1", "http://f2", "http://r1"], ["http://r2"])
    assert update_targets([], []) == ([], [])
