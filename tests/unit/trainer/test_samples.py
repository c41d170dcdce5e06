"""CompletedGroup -> samples, with the version mask."""

from __future__ import annotations

import pytest

from services.trainer.samples import build_samples
from shared.schemas import CompletedGroup, SamplingParams, Segment, Trajectory


def seg(mask: list[int], versions: list[str | None], index: int = 0) -> Segment:
    n = len(mask)
    return Segment(segment_index=index, token_ids=list(range(1, n + 1)), loss_mask=mask,
                   logprobs=[-0.5 * m for m in mask], versions=versions)


def group(gid: str, *trajs: Trajectory) -> CompletedGroup:
    return CompletedGroup(group_id=gid, prompt_id="p", failed=False, trajectories=list(trajs))


def traj(sid: str, reward: float, *segments: Segment, status: str = "completed") -> Trajectory:
    return Trajectory(session_id=sid, status=status, reward=reward, segments=list(segments))  # type: ignore[arg-type]


MIXED = seg([0, 0, 1, 1, 0, 1, 1], [None, None, "v1", "v1", None, "v2", "v2"])


@pytest.mark.parametrize(("mask_on", "kept"), [(True, [0, 0, 0, 0, 0, 1, 1]), (False, [0, 0, 1, 1, 0, 1, 1])])
def test_version_mask_keeps_only_last_version(mask_on: bool, kept: list[int]) -> None:
    out = build_samples([group("g", traj("s", 1.0, MIXED))], mask_nonlast_version=mask_on)
    assert out.samples[0].loss_mask == kept
    assert out.samples[0].versions == tuple(MIXED.versions)  # the trainer scores its own version's tokens apart
    assert out.trainable_tokens == 4
    assert out.version_masked_tokens == (2 if mask_on else 0)
    assert out.masked_token_fraction == (0.5 if mask_on else 0.0)


def test_single_version_and_unknown_tokens_are_unchanged() -> None:
    s = seg([0, 1, 1, 1], [None, "v1", "unknown", "v1"])
    out = build_samples([group("g", traj("s", 0.0, s))])
    assert out.samples[0].loss_mask == [0, 1, 1, 1]
    assert out.masked_token_fraction == 0.0


def test_rewards_are_per_trajectory_and_broadcast_to_segments() -> None:
    a = traj("a", 1.0, seg([0, 1], [None, "v1"], 0), seg([0, 1, 1], [None, "v1", "v1"], 1))
    b = traj("b", 0.0, seg([0, 1], [None, "v1"]))
    c = traj("c", 0.5, seg([0, 1], [None, "v1"]))
    out = build_samples([group("g1", a, b), group("g2", c)])
    assert out.rewards == [1.0, 0.0, 0.5]
    assert out.trajectory_group == [0, 0, 1]
    assert [s.trajectory for s in out.samples] == [0, 0, 1, 2]
    assert [s.segment_index for s in out.samples] == [0, 1, 0, 0]
    assert out.degenerate_groups == 1  # g2 has a single reward value


def test_first_position_is_never_trained() -> None:
    out = build_samples([group("g", traj("s", 1.0, seg([1, 1, 1], ["v1"] * 3)))])
    assert out.samples[0].loss_mask == [0, 1, 1]


def test_robust_to_bad_input() -> None:
    empty = seg([0, 0, 0], [None] * 3)
    bad = Segment(segment_index=1, token_ids=[1, 2], loss_mask=[0, 1, 1], logprobs=[0.0], versions=[None])
    good = seg([0, 1], [None, "v1"], 2)
    rejected = traj("r", 1.0, seg([0, 1], [None, "v1"]), status="rejected")
    out = build_samples([group("g", traj("s", 1.0, empty, bad, good), rejected)])
    assert len(out.samples) == 1
    assert out.skipped_segments == 1 and out.malformed_segments == 1 and out.skipped_trajectories == 1
    assert out.rewards == [1.0]


def test_truncation_to_the_context_window() -> None:
    s = seg([0, 1, 1, 1, 1, 1], ["v1", "v1", "v1", "v2", "v2", "v2"])
    out = build_samples([group("g", traj("s", 1.0, s))], max_tokens=3)
    assert out.truncated_segments == 1
    assert out.samples[0].token_ids == [1, 2, 3]
    assert out.samples[0].loss_mask == [0, 1, 1]  # the cut v2 tokens no longer make it mixed


def test_greedy_tokens_are_never_trained_and_are_counted() -> None:
    """Temperature 0 is a deterministic choice: nothing to raise or lower, so its tokens leave the loss;
    sampled tokens of the same segment stay, with their parameters for the trainer."""
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=20)
    s = Segment(segment_index=0, token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 1, 1, 1, 1], logprobs=[0.0] * 5,
                versions=[None, "v1", "v1", "v1", "v1"], sampling=[(None, 1), (greedy, 2), (sampled, 2)])
    out = build_samples([group("g", traj("s", 1.0, s))])
    assert out.samples[0].loss_mask == [0, 0, 0, 1, 1]
    assert out.samples[0].sampling == (None, greedy, greedy, sampled, sampled)
    assert (out.greedy_tokens, out.trainable_tokens) == (2, 2)
    all_greedy = Segment(segment_index=0, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0] * 2,
                         versions=[None, "v1"], sampling=[(None, 1), (greedy, 1)])
    assert build_samples([group("g", traj("s", 1.0, all_greedy))]).samples == []


def test_a_withheld_trajectory_stays_in_the_baseline_and_leaves_the_loss() -> None:
    import torch

    from services.trainer.loss import grpo_advantages

    stale = traj("stale", 1.0, seg([0, 1, 1, 1], [None, "v1", "v1", "v1"]), seg([0, 1], [None, "v1"], 1))
    fresh = traj("fresh", 0.0, seg([0, 1, 1], [None, "v3", "v3"]))
    other = traj("other", 0.5, seg([0, 1], [None, "v3"]))
    out = build_samples([group("g", stale, fresh), group("h", other)], withheld={"stale"})
    assert out.rewards == [1.0, 0.0, 0.5] and out.trajectory_group == [0, 0, 1]
    assert [s.session_id for s in out.samples] == ["fresh", "other"]
    assert out.withheld_trajectories == 1 and out.trainable_tokens == 2 + 1, "the fresh ones' tokens only"
    assert out.degenerate_groups == 1, "g's rewards differ (the withheld one counts); h has one"
    adv = grpo_advantages(torch.tensor(out.rewards), torch.tensor(out.trajectory_group))
    assert adv[out.samples[0].trajectory].item() == pytest.approx(-0.5), "the baseline is the mean of both"
