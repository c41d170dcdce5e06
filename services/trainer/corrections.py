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

A correction is a function from the detached :class:`Ratios` to a :class:`Weighting` (which tokens
stay, and their ``w``, if any), registered by name in :data:`CORRECTIONS`; the trainer settings, the
demo's ``--correction`` and docs/settings.md take their names from there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Self

import torch
from pydantic import BaseModel, Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.trainer.loss import MAX_LOG_RATIO, LossStats, ppo_clip_loss
from shared.registry import Registry


def band_error(band: tuple[float, float]) -> str | None:
    """Why ``band`` is no acceptance band for a ratio (None when it is one): it must hold 1, so on-policy
    tokens are always kept."""
    low, high = band
    if not 0.0 <= low <= 1.0 <= high:
        return f"{band} must satisfy 0 <= low <= 1 <= high"
    return None


@dataclass(frozen=True)
class Ratios:
    """What a correction reads of one loss evaluation, detached (all ``[B, T]``)."""

    log_ratio: torch.Tensor
    """``log(π_prox/μ)`` per token (``k = exp``): 0 off ``keep``, bounded to ±``MAX_LOG_RATIO``."""
    keep: torch.Tensor
    """The trained tokens (bool)."""
    batch_statistic: float | None = None
    """:attr:`Correction.batch_statistic` over the whole batch when this evaluation sees a part of it; None: the
    correction takes it from these tokens."""


@dataclass(frozen=True)
class Weighting:
    """What a correction decides for one loss evaluation's trained tokens (all ``[B, T]``)."""

    stays: torch.Tensor
    """Trained tokens left in the loss (bool); the others add 0 and still count in the token-mean."""
    weight: torch.Tensor | None = None
    """The detached ``w >= 0`` of the behaviour-weighted objective, 0 where a token leaves; None: ``none``'s
    objective (PPO-clip on π_θ/μ, with the dual clip) on the tokens that stay."""
    clipped: torch.Tensor | None = None
    """Trained tokens whose weight was truncated (bool); None: none."""


@dataclass(frozen=True)
class Correction:
    """One off-policy correction, as :data:`CORRECTIONS` registers it."""

    weigh: Callable[[CorrectionSettings, Ratios], Weighting]
    batch_statistic: Callable[[CorrectionSettings, torch.Tensor], float] | None = None
    """A number ``weigh`` reads over the whole batch (M2PO's cutoff), from the log-ratios of its trained tokens
    (1-D): when the batch is split (micro-batches, ranks) the trainer computes it over all of them first, so
    the split changes nothing."""
    proximal: bool = False
    """Whether ``weigh`` reads a π_prox apart from π_θ when the loss is given one (``decoupled``); else π_prox
    is π_θ detached."""


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
    what the corrections read (the trainer computes it once more, per micro-batch, for a correction's
    batch statistic, so it must be this very function)."""
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


def _on(stays: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` on the tokens that stay, 0 on the others."""
    return torch.where(stays, weight, torch.zeros_like(weight))


def ppo(cfg: CorrectionSettings, t: Ratios) -> Weighting:
    """``none``: every trained token, under :func:`ppo_clip_loss`'s objective."""
    return Weighting(t.keep)


def tis(cfg: CorrectionSettings, t: Ratios) -> Weighting:
    """``tis`` (and ``decoupled``, whose ``k`` is π_prox/μ): ``w = min(k, C)``."""
    k = torch.exp(t.log_ratio)
    return Weighting(t.keep, _on(t.keep, torch.clamp(k, max=cfg.tis_cap)), t.keep & (k > cfg.tis_cap))


def icepop(cfg: CorrectionSettings, t: Ratios) -> Weighting:
    """``icepop``: ``w = k`` for ``k`` in [α, β]; the other tokens leave the loss."""
    k = torch.exp(t.log_ratio)
    stays = t.keep & (k >= cfg.icepop_band[0]) & (k <= cfg.icepop_band[1])
    return Weighting(stays, _on(stays, k))


def geo_mask(cfg: CorrectionSettings, t: Ratios) -> Weighting:
    """``geo_mask``: ``none``'s objective on the samples whose geometric-mean ratio lies in the band."""
    return Weighting(t.keep & geo_mask_rows(t.log_ratio, t.keep, cfg.geo_mask_band).unsqueeze(-1))


def m2po_batch_cutoff(cfg: CorrectionSettings, log_ratios: torch.Tensor) -> float:
    """M2PO's :func:`m2po_cutoff` over the log-ratios of a batch's trained tokens (float64: the cutoff lies
    strictly between two float32 values)."""
    return m2po_cutoff(log_ratios.to(torch.float64) ** 2, cfg.m2po_threshold)


def m2po(cfg: CorrectionSettings, t: Ratios) -> Weighting:
    """``m2po``: ``w = k`` for the tokens the batch's cutoff keeps (``(log k)² <= cutoff``); the others leave."""
    cutoff = m2po_batch_cutoff(cfg, t.log_ratio[t.keep]) if t.batch_statistic is None else t.batch_statistic
    stays = t.keep & (t.log_ratio.to(torch.float64) ** 2 <= cutoff)
    return Weighting(stays, _on(stays, torch.exp(t.log_ratio)))


CORRECTIONS: Registry[Correction] = Registry("correction", {
    "none": Correction(ppo),
    "tis": Correction(tis),
    "icepop": Correction(icepop),
    "geo_mask": Correction(geo_mask),
    "m2po": Correction(m2po, batch_statistic=m2po_batch_cutoff),
    "decoupled": Correction(tis, proximal=True),
})
"""Every correction by name (``REIN_OFFPOLICY_CORRECTION``, ``make demo --correction``): one entry each."""


class CorrectionSettings(BaseModel):
    """Which correction the loss applies and its knobs, declared once: the trainer's settings take them as a
    mixin (``REIN_OFFPOLICY_CORRECTION``, ``REIN_TIS_CAP``, ...); a test or a bench builds one directly."""

    model_config = SettingsConfigDict(use_attribute_docstrings=True, extra="forbid")  # a mixin of TrainerSettings

    offpolicy_correction: Annotated[str, CORRECTIONS] = "none"
    """Off-policy correction of the loss, by its name in ``services.trainer.corrections.CORRECTIONS``
    (docs/architecture.md, "Off-policy corrections in the loss"); ``none`` is PPO-clip on the trainer/rollout
    ratio. Each logs the share of trained tokens it masked or clipped and the weights' ESS."""
    tis_cap: float = Field(default=2.0, ge=1.0)
    """C of ``tis`` and ``decoupled``: the behaviour importance weight is min(ratio, C) (slime's and verl's 2.0)."""
    icepop_band: tuple[float, float] = (0.5, 5.0)
    """[low, high] of ``icepop``: tokens whose trainer/rollout ratio lies outside leave the loss (verl's
    ``0.5_5.0``). JSON, e.g. ``[0.5, 5.0]``; low <= 1 <= high."""
    geo_mask_band: tuple[float, float] = (0.5, 2.0)
    """[low, high] of ``geo_mask`` for a sample's geometric-mean ratio over its trained tokens (slime's
    bounds 0.5 / 2.0); low <= 1 <= high."""
    m2po_threshold: float = Field(default=0.04, gt=0)
    """τ of ``m2po``: tokens with the largest squared log-ratio leave the loss until the batch's mean squared
    log-ratio is at most τ (AReaL's example 0.04)."""

    @model_validator(mode="after")
    def _check_bands(self) -> Self:
        for name, band in (("icepop_band", self.icepop_band), ("geo_mask_band", self.geo_mask_band)):
            if (error := band_error(band)) is not None:
                raise ValueError(f"{name} (REIN_{name.upper()}) {error}")
        return self


def corrected_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: CorrectionSettings | None = None,
    clip_eps: float = 0.2,
    is_truncation: float | None = 2.0,
    normalizer: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    batch_statistic: float | None = None,
) -> tuple[torch.Tensor, LossStats, CorrectionStats]:
    """The policy loss under ``correction`` (None: ``none``); shapes and mask as :func:`ppo_clip_loss`.

    The registered :class:`Correction` of its kind weighs the trained tokens; its :class:`Weighting`
    picks the objective:

    - no ``weight``: :func:`ppo_clip_loss` on the tokens that stay (``none``: all of them, exactly
      :func:`ppo_clip_loss`);
    - a ``weight``: ``w · min(r·A, clip(r, 1−ε, 1+ε)·A)`` with ``r = π_θ/π_prox``.

    ``proximal_logprobs`` ``[B, T]``: π_prox for a correction that reads one (``decoupled``; None:
    ``logprobs`` detached, the one-update case, where ``decoupled`` equals ``tis``).
    ``batch_statistic``: the correction's statistic over the whole batch when this call sees one
    micro-batch of it (M2PO's cutoff); None takes it from this call's tokens.

    Returns the scalar loss, :class:`LossStats` over every trained token (``ratio_mean`` and the
    |diff| compare π_θ with μ; ``clip_fraction`` counts PPO clips of the ratio the objective
    clips) and :class:`CorrectionStats`.
    """
    cfg = correction or CorrectionSettings()
    kind = CORRECTIONS[cfg.offpolicy_correction]
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
    if kind.proximal and proximal_logprobs is not None:
        if proximal_logprobs.shape != logprobs.shape:
            raise ValueError(f"proximal_logprobs {tuple(proximal_logprobs.shape)} must be {tuple(logprobs.shape)}")
        proximal = torch.where(keep, proximal_logprobs.detach().to(logprobs.dtype), torch.zeros_like(logprobs))
        proximal_log_ratio = behaviour_log_ratio(proximal, rollout_logprobs, keep)
    else:
        proximal, proximal_log_ratio = current.detach(), log_ratio
    with torch.no_grad():
        weighting = kind.weigh(cfg, Ratios(proximal_log_ratio, keep, batch_statistic))
    stays = weighting.stays
    masked = int((keep & ~stays).sum().item())
    clipped = 0 if weighting.clipped is None else int(weighting.clipped.sum().item())
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logprobs)

    if weighting.weight is None:
        loss, _ = ppo_clip_loss(
            logprobs, rollout_logprobs, advantages, stays,
            clip_eps=clip_eps, is_truncation=is_truncation, normalizer=denom,
        )
        with torch.no_grad():
            clip_hit = stays & (((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps)))
            truncated = (
                stays & (adv < 0) & (ratio > is_truncation) if is_truncation is not None else torch.zeros_like(keep)
            )
        return (
            loss,
            _loss_stats(current, rollout, ratio, keep, clip_hit, truncated),
            _correction_stats(keep, _on(stays, ratio), masked, clipped),
        )

    w = weighting.weight
    r = torch.exp((current - proximal).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    surrogate = torch.minimum(r * adv, torch.clamp(r, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    objective = torch.where(stays, w * surrogate, torch.zeros_like(surrogate))
    loss = -objective.sum() / denom
    with torch.no_grad():
        clip_hit = stays & (((adv > 0) & (r > 1.0 + clip_eps)) | ((adv < 0) & (r < 1.0 - clip_eps)))
    return (
        loss,
        _loss_stats(current, rollout, ratio, keep, clip_hit, torch.zeros_like(keep)),
        _correction_stats(keep, w, masked, clipped),
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
