"""GRPO advantages and the PPO-clip loss."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import entropy_bonus, grpo_advantages, ppo_clip_loss


def test_advantage_is_reward_minus_group_mean() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.2, 0.4]), torch.tensor([0, 0, 0, 1, 1]))
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, -0.1, 0.1]), atol=1e-6)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_zero_variance_group_gives_exact_zeros(normalize_std: bool) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: the constant group must still be exactly 0, never NaN
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0]), torch.tensor([0, 0, 0, 1, 1]),
                          normalize_std=normalize_std)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert not torch.isnan(adv).any()


def test_std_normalisation_divides_by_population_std() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 2]), normalize_std=True)
    assert torch.allclose(adv[:2], torch.tensor([1.0, -1.0]), atol=1e-4)  # centred ±0.5, std 0.5
    assert torch.equal(adv[2:], torch.zeros(2))  # singleton groups: zero variance


def test_empty_rewards() -> None:
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def _pg_grad(logits: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, -1)[..., 0]
    loss = -(lp * adv.unsqueeze(-1) * mask).sum() / mask.sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return grad


def test_equal_logprobs_give_the_policy_gradient() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 4, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 0.25])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32)
    lp = torch.log_softmax(logits, -1)[..., 0]
    loss, stats = ppo_clip_loss(lp, lp.detach().clone(), adv, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(grad, _pg_grad(logits, adv, mask), atol=1e-6)
    assert stats.clip_fraction == 0.0 and stats.truncated_fraction == 0.0
    assert stats.train_rollout_logprob_abs_diff == pytest.approx(0.0, abs=1e-7)
    assert stats.trained_tokens == int(mask.sum())


def test_masked_tokens_contribute_nothing_even_nan() -> None:
    lp = torch.tensor([[-1.0, float("nan"), -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, float("inf"), -2.0]])
    mask = torch.tensor([[1, 0, 1]])
    loss, stats = ppo_clip_loss(lp, rollout, torch.tensor([1.0]), mask)
    loss.backward()
    assert lp.grad is not None
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1] == 0.0
    assert stats.trained_tokens == 2


@pytest.mark.parametrize(
    ("log_ratio", "adv", "grad_zero", "clipped", "truncated"),
    [
        (math.log(1.5), 1.0, True, True, False),  # above 1+ε with A>0: PPO clip
        (math.log(1.1), 1.0, False, False, False),  # inside the trust region
        (math.log(0.5), -1.0, True, True, False),  # below 1−ε with A<0: PPO clip
        (math.log(0.5), 1.0, False, False, False),  # below 1−ε but A>0: still pushed up
        (math.log(1.5), -1.0, False, False, False),  # above 1+ε with A<0, under the truncation: pushed down
        (math.log(3.0), -1.0, True, False, True),  # above is_truncation with A<0: dual clip
    ],
)
def test_clipping_table(log_ratio: float, adv: float, grad_zero: bool, clipped: bool, truncated: bool) -> None:
    lp = torch.tensor([[-1.0 + log_ratio]], requires_grad=True)
    loss, stats = ppo_clip_loss(lp, torch.tensor([[-1.0]]), torch.tensor([adv]), torch.ones(1, 1),
                                clip_eps=0.2, is_truncation=2.0)
    loss.backward()
    assert lp.grad is not None
    assert (lp.grad.abs().item() == 0.0) is grad_zero
    assert stats.clip_fraction == (1.0 if clipped else 0.0)
    assert stats.truncated_fraction == (1.0 if truncated else 0.0)
    assert stats.train_rollout_logprob_abs_diff == pytest.approx(abs(log_ratio), rel=1e-5)


def test_no_truncation_leaves_ratio_unbounded_for_negative_advantage() -> None:
    lp = torch.tensor([[-1.0 + math.log(3.0)]], requires_grad=True)
    loss, _ = ppo_clip_loss(lp, torch.tensor([[-1.0]]), torch.tensor([-1.0]), torch.ones(1, 1), is_truncation=None)
    assert loss.item() == pytest.approx(3.0, rel=1e-5)


def test_abs_diff_is_mean_over_trained_tokens_only() -> None:
    lp = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -9.0, -0.0]])
    _, stats = ppo_clip_loss(lp, rollout, torch.zeros(1), torch.tensor([[1, 0, 1]]))
    assert stats.train_rollout_logprob_abs_diff == pytest.approx((0.5 + 1.0) / 2)


def test_normalizer_makes_micro_batches_add_up() -> None:
    torch.manual_seed(1)
    lp = torch.randn(4, 6)
    rollout = lp + 0.1 * torch.randn(4, 6)
    adv = torch.randn(4)
    mask = (torch.rand(4, 6) > 0.3).float()
    full, _ = ppo_clip_loss(lp, rollout, adv, mask)
    n = float(mask.sum())
    parts = [ppo_clip_loss(lp[i : i + 2], rollout[i : i + 2], adv[i : i + 2], mask[i : i + 2], normalizer=n)[0]
             for i in (0, 2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-5)


def test_shape_and_setting_errors() -> None:
    with pytest.raises(ValueError, match="must all be"):
        ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="is_truncation"):
        ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), is_truncation=1.1)


def test_entropy_bonus_is_the_token_mean_over_trained_tokens() -> None:
    entropy = torch.tensor([[1.0, float("nan"), 3.0], [0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert entropy_bonus(entropy, mask).item() == pytest.approx((1.0 + 3.0 + 0.5 + 0.5) / 4)
    assert entropy_bonus(entropy, mask, normalizer=10.0).item() == pytest.approx(0.5)
    assert entropy_bonus(entropy, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError, match="must both be"):
        entropy_bonus(entropy[:, :2], mask)


def test_entropy_bonus_gradient_flattens_the_distribution() -> None:
    """Subtracting the bonus and descending raises the entropy of a peaked distribution."""
    logits = torch.tensor([[[3.0, 0.0, -1.0, 0.5]]], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    (-entropy_bonus(entropy, torch.ones(1, 1))).backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None
    stepped = logits.detach() - 0.5 * logits.grad
    after = torch.log_softmax(stepped, -1)
    assert -(after.exp() * after).sum() > entropy.detach().sum()
