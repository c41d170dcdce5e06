"""Off-policy corrections of the policy loss, pure torch (no I/O, no model).

Three policies meet in a token's loss: the behaviour policy μ (the engine's logprob when it
sampled the token, recorded per token, possibly several versions old), the proximal policy
π_prox (the trainer's weights before this update) and the current policy π_θ (the weights
being optimised). rein takes one optimizer update per batch, so at loss time π_θ = π_prox in
value: the proximal logprob is the trainer's own logprob, detached, at no extra cost.

``none`` is today's objective, :func:`~services.trainer.loss.ppo_clip_loss`, which clips the
whole ratio π_θ/μ. The other corrections come in two shapes:

- Behaviour-weighted (``tis``, ``icepop``, ``m2po``, ``decoupled``): each trained token's
  objective is ``w · min(r·A, clip(r, 1−ε, 1+ε)·A)`` with ``r = π_θ/π_prox`` and ``w ≥ 0``
  a detached weight made from the behaviour ratio ``k = π_prox/μ``. With π_prox = π_θ
  detached, ``r`` is 1 in value, the clip never binds and the gradient is ``w·A·∇log π_θ``:
  the whole off-policy control is ``w``. PPO's dual clip (``is_truncation``) is not applied:
  ``w``'s own cap or mask takes its place.
- Filter (``geo_mask``): today's objective, on the samples it keeps.

Every correction keeps the loss's denominator: a token it removes still counts in ``n`` (or in
``normalizer``) and adds 0, so removing tokens never scales up the others, and micro-batches
sharing one token-mean add up exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from services.trainer.loss import MAX_LOG_RATIO, LossStats, ppo_clip_loss

Correction = Literal["none", "tis", "icepop", "geo_mask", "m2po", "decoupled"]
CORRECTIONS: tuple[str, ...] = get_args(Correction)


def band_error(band: tuple[float, float]) -> str | None:
    """Why ``band`` is no acceptance band for a ratio (None when it is one): it must hold 1, so on-policy
    tokens are always kept."""
    low, high = band
    if not 0.0 <= low <= 1.0 <= high:
        return f"{band} must satisfy 0 <= low <= 1 <= high"
    return None


@dataclass(frozen=True)
class CorrectionConfig:
    """Which correction the loss applies and its knobs (mirrors the trainer settings)."""

    kind: Correction = "none"
    tis_cap: float = 2.0
    """C in ``w = min(k, C)`` (``tis`` and ``decoupled``); at least 1, so a ratio of 1 keeps weight 1."""
    icepop_band: tuple[float, float] = (0.5, 5.0)
    """[α, β] of ``icepop``: tokens with ``k`` outside leave the loss."""
    geo_mask_band: tuple[float, float] = (0.5, 2.0)
    """Band of ``geo_mask`` for a sample's geometric-mean ratio over its trained tokens."""
    m2po_threshold: float = 0.04
    """τ of ``m2po``: bound on the mean squared log-ratio of the batch's tokens that stay."""

    def __post_init__(self) -> None:
        if self.kind not in CORRECTIONS:
            raise ValueError(f"unknown correction {self.kind!r}; one of {', '.join(CORRECTIONS)}")
        if not self.tis_cap >= 1.0:
            raise ValueError(f"tis_cap ({self.tis_cap}) must be >= 1")
        for name, band in (("icepop_band", self.icepop_band), ("geo_mask_band", self.geo_mask_band)):
            if (error := band_error(band)) is not None:
                raise ValueError(f"{name} {error}")
        if not self.m2po_threshold > 0.0:
            raise ValueError(f"m2po_threshold ({self.m2po_threshold}) must be > 0")


@dataclass(frozen=True)
class CorrectionStats:
    """What a correction did to the trained tokens of one loss evaluation.

    Sums, so the micro-batches of one step add up (``+``). ``weight_*`` are over the weights
    the objective applied per trained token: ``w`` for the behaviour-weighted corrections, the
    importance ratio π_θ/μ for ``none`` and ``geo_mask``; a removed token weighs 0.
    """

    tokens: int = 0
    masked: int = 0
    """Trained tokens the correction removed from the loss."""
    clipped: int = 0
    """Trained tokens whose weight the correction truncated (``k > C``)."""
    weight_sum: float = 0.0
    weight_sq_sum: float = 0.0

    def __add__(self, other: CorrectionStats) -> CorrectionStats:
        return CorrectionStats(
            self.tokens + other.tokens, self.masked + other.masked, self.clipped + other.clipped,
            self.weight_sum + other.weight_sum, self.weight_sq_sum + other.weight_sq_sum,
        )

    @property
    def masked_fraction(self) -> float:
        return self.masked / self.tokens if self.tokens else 0.0

    @property
    def clipped_fraction(self) -> float:
        return self.clipped / self.tokens if self.tokens else 0.0

    @property
    def ess(self) -> float | None:
        """Normalised effective sample size ``(Σw)² / (n·Σw²)`` in [0, 1]: 1 when every weight is equal,
        near 1/n when one token carries the batch, 0 when every token was removed; None without tokens."""
        if self.tokens == 0:
            return None
        if self.weight_sq_sum <= 0.0:
            return 0.0
        return min(1.0, self.weight_sum**2 / (self.tokens * self.weight_sq_sum))


def behaviour_log_ratio(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached ``log(π/μ)`` per token ``[B, T]``, 0 off the mask and bounded to ±``MAX_LOG_RATIO``:
    what the masks of this module read (the trainer computes it once more, per micro-batch, for M2PO's
    batch-wide cutoff, so it must be this very function)."""
    keep = mask.to(torch.bool)
    with torch.no_grad():
        current = torch.where(keep, logprobs.detach(), torch.zeros_like(logprobs))
        rollout = torch.where(keep, rollout_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
        return (current - rollout).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def m2po_cutoff(sq_log_ratios: torch.Tensor, threshold: float) -> float:
    """The squared log-ratio above which a token leaves the loss under M2PO.

    Removing the tokens with the largest squared log-ratio, one value at a time, until the mean
    of those left is at most ``threshold`` keeps exactly the tokens whose value is ``<=`` the
    returned cutoff. Tokens with equal values stay or go together (no order among them decides).
    The cutoff lies halfway between the largest value kept and the smallest removed, so a
    recomputation of the same values that differs in the last bits (another micro-batch's
    forward pass) draws the same line. ``inf`` when nothing is removed (no values included);
    ``-inf`` when even the smallest values' mean exceeds the threshold (every token goes).
    """
    values = sq_log_ratios.detach().reshape(-1).to(torch.float64)
    if values.numel() == 0:
        return math.inf
    ordered, _ = torch.sort(values)
    means = torch.cumsum(ordered, 0) / torch.arange(1, ordered.numel() + 1, dtype=torch.float64)
    run_end = torch.ones_like(ordered, dtype=torch.bool)
    run_end[:-1] = ordered[1:] != ordered[:-1]  # the mean over all values <= v is taken at v's last copy
    ok = torch.nonzero(run_end & (means <= threshold)).reshape(-1)
    if ok.numel() == 0:
        return -math.inf
    last = int(ok[-1].item())
    if last == ordered.numel() - 1:
        return math.inf
    return float((ordered[last] + ordered[last + 1]).item() / 2)


def geo_mask_rows(log_ratio: torch.Tensor, keep: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    """Per sample (row), whether its geometric-mean ratio over its trained tokens lies in ``band``.

    ``log_ratio`` and ``keep``: ``[B, T]``; returns bool ``[B]``. A row without trained tokens has
    geometric mean 1 and is kept (it adds nothing either way).
    """
    count = keep.sum(-1).clamp(min=1)
    mean = torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).sum(-1) / count
    geo = torch.exp(mean)
    return (geo >= band[0]) & (geo <= band[1])


def behaviour_weights(
    cfg: CorrectionConfig, log_ratio: torch.Tensor, keep: torch.Tensor, m2po_cutoff_value: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The detached weight ``w`` of a behaviour-weighted correction (``tis``, ``icepop``, ``m2po``,
    ``decoupled``) from ``log_ratio`` = ``log(π_prox/μ)``, with the tokens that stay in the loss and
    those whose weight was truncated (all ``[B, T]``; ``w`` is 0 wherever a token does not stay)."""
    if cfg.kind not in ("tis", "icepop", "m2po", "decoupled"):
        raise ValueError(f"{cfg.kind!r} is no behaviour-weighted correction")
    with torch.no_grad():
        k = torch.exp(log_ratio)
        stays = keep
        clipped = torch.zeros_like(keep)
        if cfg.kind in ("tis", "decoupled"):
            clipped = keep & (k > cfg.tis_cap)
            w = torch.clamp(k, max=cfg.tis_cap)
        elif cfg.kind == "icepop":
            stays = keep & (k >= cfg.icepop_band[0]) & (k <= cfg.icepop_band[1])
            w = k
        else:  # m2po
            sq = log_ratio.to(torch.float64) ** 2  # float64: the cutoff lies strictly between two float32 values
            cutoff = m2po_cutoff(sq[keep], cfg.m2po_threshold) if m2po_cutoff_value is None else m2po_cutoff_value
            stays = keep & (sq <= cutoff)
            w = k
        return torch.where(stays, w, torch.zeros_like(w)), stays, clipped


def corrected_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: CorrectionConfig | None = None,
    clip_eps: float = 0.2,
    is_truncation: float | None = 2.0,
    normalizer: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    m2po_cutoff_value: float | None = None,
) -> tuple[torch.Tensor, LossStats, CorrectionStats]:
    """The policy loss under ``correction`` (None: ``none``); shapes and mask as :func:`ppo_clip_loss`.

    - ``none``: exactly :func:`ppo_clip_loss`.
    - ``tis``: ``w = min(k, C)``.
    - ``icepop``: ``w = k`` for ``k`` in [α, β], else 0 (the token leaves the loss).
    - ``geo_mask``: :func:`ppo_clip_loss` on the samples whose geometric-mean ``π_θ/μ`` over their
      trained tokens lies in the band; the others leave the loss whole.
    - ``m2po``: ``w = k`` for the tokens :func:`m2po_cutoff` keeps (``(log k)² <= cutoff``), else 0.
      ``m2po_cutoff_value``: the batch's cutoff when this call sees one micro-batch of it; None
      takes it from this call's tokens.
    - ``decoupled``: ``w = min(π_prox/μ, C)`` and the PPO clip on ``π_θ/π_prox``;
      ``proximal_logprobs`` ``[B, T]`` (None: ``logprobs`` detached, the one-update case, where
      it equals ``tis``).

    Returns the scalar loss, :class:`LossStats` over every trained token (``ratio_mean`` and the
    |diff| compare π_θ with μ; ``clip_fraction`` counts PPO clips of the ratio the objective
    clips) and :class:`CorrectionStats`.
    """
    cfg = correction or CorrectionConfig()
    keep = mask.to(torch.bool)
    if logprobs.shape != rollout_logprobs.shape or logprobs.shape != keep.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must all be [B, T]"
        )
    current = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    rollout = torch.where(keep, rollout_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    log_ratio = behaviour_log_ratio(logprobs, rollout_logprobs, keep)
    ratio = torch.exp(log_ratio)
    count = int(keep.sum().item())
    denom = float(normalizer) if normalizer is not None else float(max(count, 1))

    if cfg.kind == "none":
        loss, stats = ppo_clip_loss(
            logprobs, rollout_logprobs, advantages, mask,
            clip_eps=clip_eps, is_truncation=is_truncation, normalizer=normalizer,
        )
        return loss, stats, _correction_stats(keep, torch.where(keep, ratio, torch.zeros_like(ratio)), 0, 0)

    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logprobs)

    if cfg.kind == "geo_mask":
        kept_rows = geo_mask_rows(log_ratio, keep, cfg.geo_mask_band)
        stays = keep & kept_rows.unsqueeze(-1)
        loss, _ = ppo_clip_loss(
            logprobs, rollout_logprobs, advantages, stays,
            clip_eps=clip_eps, is_truncation=is_truncation, normalizer=denom,
        )
        with torch.no_grad():
            clip_hit = stays & (((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps)))
            truncated = (
                stays & (adv < 0) & (ratio > is_truncation) if is_truncation is not None else torch.zeros_like(keep)
            )
            weights = torch.where(stays, ratio, torch.zeros_like(ratio))
        masked = int((keep & ~stays).sum().item())
        return (
            loss,
            _loss_stats(current, rollout, ratio, keep, clip_hit, truncated),
            _correction_stats(keep, weights, masked, 0),
        )

    if cfg.kind == "decoupled" and proximal_logprobs is not None:
        if proximal_logprobs.shape != logprobs.shape:
            raise ValueError(f"proximal_logprobs {tuple(proximal_logprobs.shape)} must be {tuple(logprobs.shape)}")
        proximal = torch.where(keep, proximal_logprobs.detach().to(logprobs.dtype), torch.zeros_like(logprobs))
        proximal_log_ratio = behaviour_log_ratio(proximal, rollout_logprobs, keep)
    else:
        proximal, proximal_log_ratio = current.detach(), log_ratio
    w, stays, clipped = behaviour_weights(cfg, proximal_log_ratio, keep, m2po_cutoff_value)
    r = torch.exp((current - proximal).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    surrogate = torch.minimum(r * adv, torch.clamp(r, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    objective = torch.where(stays, w * surrogate, torch.zeros_like(surrogate))
    loss = -objective.sum() / denom
    with torch.no_grad():
        clip_hit = stays & (((adv > 0) & (r > 1.0 + clip_eps)) | ((adv < 0) & (r < 1.0 - clip_eps)))
    masked = int((keep & ~stays).sum().item())
    return (
        loss,
        _loss_stats(current, rollout, ratio, keep, clip_hit, torch.zeros_like(keep)),
        _correction_stats(keep, w, masked, int(clipped.sum().item())),
    )


def _loss_stats(
    current: torch.Tensor,
    rollout: torch.Tensor,
    ratio: torch.Tensor,
    keep: torch.Tensor,
    clip_hit: torch.Tensor,
    truncated: torch.Tensor,
) -> LossStats:
    count = int(keep.sum().item())
    n = max(count, 1)
    with torch.no_grad():
        return LossStats(
            trained_tokens=count,
            train_rollout_logprob_abs_diff=float((current - rollout).abs()[keep].sum().item() / n),
            clip_fraction=float(clip_hit.sum().item() / n),
            truncated_fraction=float(truncated.sum().item() / n),
            ratio_mean=float(ratio[keep].sum().item() / n) if count else 1.0,
        )


def _correction_stats(keep: torch.Tensor, weights: torch.Tensor, masked: int, clipped: int) -> CorrectionStats:
    w = weights.detach()[keep].to(torch.float64)
    return CorrectionStats(
        tokens=int(keep.sum().item()), masked=masked, clipped=clipped,
        weight_sum=float(w.sum().item()), weight_sq_sum=float((w * w).sum().item()),
    )
