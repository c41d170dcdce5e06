"""GRPO advantages and the PPO-clip objective, pure torch (no I/O, no model).

Shapes: ``B`` samples (segments), ``T`` token positions of the right-padded batch,
``N`` trajectories. One optimizer update is taken per batch, so PPO's "old policy"
is the behaviour policy itself: the ratio compares the trainer's current logprob
with the logprob the engine reported when it sampled the token. Staleness (weights
a few versions old) and numeric differences between engine and trainer both show
up in that ratio; PPO's clip bounds how far one step moves a token, and the
truncation bounds the ratio of tokens the trainer now finds far likelier than the
stale rollout did (dual clip for negative advantages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps the ratio finite so 0 * ratio stays 0


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Per-trajectory advantage: reward minus its group's mean reward.

    ``rewards``: float ``[N]``; ``group_ids``: long ``[N]`` in ``0..G-1``. With
    ``normalize_std`` the centred reward is divided by the group's population std
    (+ ``eps``). A group whose rewards are all equal gets exactly 0 (never NaN),
    also under float rounding of its mean. Returns float ``[N]``.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal [N]")
    if rewards.numel() == 0:
        return rewards.clone()
    rewards = rewards.to(torch.float64)
    groups = int(group_ids.max().item()) + 1
    counts = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(rewards))
    means = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_ids, rewards) / counts.clamp(min=1)
    centred = rewards - means[group_ids]
    hi = torch.full((groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group_ids, rewards, "amax")
    lo = torch.full((groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, group_ids, rewards, "amin")
    constant = (hi == lo)[group_ids]
    if normalize_std:
        var = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_ids, centred**2) / counts.clamp(min=1)
        centred = centred / (var.sqrt()[group_ids] + eps)
    return torch.where(constant, torch.zeros_like(centred), centred).to(torch.float32)


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation, over trained tokens only (detached floats)."""

    trained_tokens: int
    train_rollout_logprob_abs_diff: float
    """Mean |trainer logprob − rollout logprob|: how far the trainer's policy is from the one that sampled."""
    clip_fraction: float
    """Share of tokens whose gradient PPO's clip removed (ratio beyond 1 ± ε in the advantage's direction)."""
    truncated_fraction: float
    """Share of tokens with a negative advantage whose ratio exceeded ``is_truncation``."""
    ratio_mean: float


def ppo_clip_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    is_truncation: float | None = 2.0,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Token-mean PPO-clip loss with a truncated importance ratio.

    - ``logprobs``: float ``[B, T]``, the trainer's logprob of each token (carries the gradient).
    - ``rollout_logprobs``: float ``[B, T]``, the engine's logprob of the same token at sampling time.
    - ``advantages``: float ``[B]`` (broadcast over tokens) or ``[B, T]``.
    - ``mask``: ``[B, T]`` bool or 0/1; 1 means "this token is trained": a sampled
      token kept by the version mask. Prompt, environment, padding and stale-version
      tokens are 0 and contribute nothing, not even NaNs from their positions.

    Per token, with ``r = exp(logprob − rollout_logprob)`` and advantage ``A``:
    ``objective = min(r·A, clip(r, 1−ε, 1+ε)·A)``, and for ``A < 0`` additionally
    ``max(objective, is_truncation·A)``. The loss is ``−Σ objective / n`` over trained
    tokens, ``n`` = their count, or ``normalizer`` when micro-batches share one
    token-mean. With equal logprobs (r = 1) its gradient is the plain policy gradient
    ``−Σ A·∇logprob / n``. Returns the scalar loss and :class:`LossStats`.
    """
    if logprobs.shape != rollout_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must all be [B, T]"
        )
    if is_truncation is not None and is_truncation <= 1.0 + clip_eps:
        raise ValueError(f"is_truncation ({is_truncation}) must exceed 1 + clip_eps ({1.0 + clip_eps})")
    keep = mask.to(torch.bool)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logprobs)
    rollout = torch.where(keep, rollout_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    current = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    log_ratio = (current - rollout).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    objective = torch.minimum(unclipped, clipped)
    truncated = torch.zeros_like(keep)
    if is_truncation is not None:
        truncated = keep & (adv < 0) & (ratio > is_truncation)
        objective = torch.where(adv < 0, torch.maximum(objective, is_truncation * adv), objective)
    objective = torch.where(keep, objective, torch.zeros_like(objective))
    count = int(keep.sum().item())
    denom = float(normalizer) if normalizer is not None else float(max(count, 1))
    loss = -objective.sum() / denom

    with torch.no_grad():
        clip_hit = keep & (((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps)))
        n = max(count, 1)
        stats = LossStats(
            trained_tokens=count,
            train_rollout_logprob_abs_diff=float((current - rollout).abs()[keep].sum().item() / n),
            clip_fraction=float(clip_hit.sum().item() / n),
            truncated_fraction=float(truncated.sum().item() / n),
            ratio_mean=float(ratio[keep].sum().item() / n) if count else 1.0,
        )
    return loss, stats


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, *, normalizer: float | None = None) -> torch.Tensor:
    """Token-mean entropy over trained tokens, the term an entropy bonus subtracts from the loss.

    - ``entropy``: float ``[B, T]``, the entropy (nats) of the distribution each token was sampled
      from, as the trainer's current weights give it (carries the gradient).
    - ``mask``: ``[B, T]`` bool or 0/1, the same "trained" mask as :func:`ppo_clip_loss`'s; other
      positions contribute nothing.

    Returns ``Σ entropy / n`` over trained tokens, ``n`` = their count or ``normalizer`` (micro-batches
    sharing one token-mean), a scalar. The trainer's loss is ``policy_loss − coef · entropy_bonus``:
    every trained position is pushed toward a flatter distribution, in proportion to ``coef``, so a
    policy trained from scratch does not turn near-deterministic (and stop exploring) before it has
    found what pays.
    """
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must both be [B, T]")
    keep = mask.to(torch.bool)
    denom = float(normalizer) if normalizer is not None else float(max(int(keep.sum().item()), 1))
    return torch.where(keep, entropy, torch.zeros_like(entropy)).sum() / denom
