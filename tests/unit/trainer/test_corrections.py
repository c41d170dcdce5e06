"""Off-policy corrections of the loss, on hand-computed tensors and as properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.corrections import (
    CORRECTIONS,
    CorrectionSettings,
    CorrectionStats,
    Ratios,
    behaviour_log_ratio,
    corrected_loss,
    geo_mask_rows,
    m2po_cutoff,
)
from services.trainer.loss import ppo_clip_loss

WEIGHTED = ("tis", "icepop", "m2po", "decoupled")


def _tokens(ratios: list[list[float]], base: float = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer logprobs (a leaf that records its gradient) and rollout logprobs with π/μ = ``ratios``."""
    k = torch.tensor(ratios, dtype=torch.float64)
    lp = torch.full_like(k, base).requires_grad_(True)
    return lp, (lp.detach() - torch.log(k))


def _grad(loss: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, lp)
    return grad


def _ess(weights: list[float]) -> float:
    return sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))


# ------------------------------------------------------------------ none = today's loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("normalizer", [None, 50.0])
def test_none_is_exactly_todays_loss_and_gradient(seed: int, normalizer: float | None) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(4, 7, 5)
    rollout = torch.log_softmax(logits + 0.5 * torch.randn(4, 7, 5), -1)[..., 0]
    adv = torch.randn(4)
    mask = torch.rand(4, 7) > 0.3
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    loss_a, stats_a, _ = corrected_loss(torch.log_softmax(a, -1)[..., 0], rollout, adv, mask, normalizer=normalizer)
    loss_b, stats_b = ppo_clip_loss(torch.log_softmax(b, -1)[..., 0], rollout, adv, mask, normalizer=normalizer)
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(_grad(loss_a, a), _grad(loss_b, b))
    assert stats_a == stats_b


def test_none_reports_the_importance_ratios_ess() -> None:
    lp, rollout = _tokens([[0.5, 1.0, 4.0]])
    _, _, c = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 3))
    assert (c.tokens, c.masked, c.clipped) == (3, 0, 0)
    assert c.ess == pytest.approx(_ess([0.5, 1.0, 4.0]))


# ------------------------------------------------------------------ each correction by hand


def test_tis_truncates_the_weight_and_moves_every_token() -> None:
    lp, rollout = _tokens([[0.5, 1.0, 3.0]])
    cfg = CorrectionSettings(offpolicy_correction="tis", tis_cap=2.0)
    loss, stats, c = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 3), correction=cfg)
    w = [0.5, 1.0, 2.0]
    assert loss.item() == pytest.approx(-sum(w) / 3)
    assert torch.allclose(_grad(loss, lp), torch.tensor([[-x / 3 for x in w]], dtype=torch.float64))
    assert (c.masked, c.clipped) == (0, 1) and c.clipped_fraction == pytest.approx(1 / 3)
    assert c.ess == pytest.approx(_ess(w))
    assert stats.clip_fraction == 0.0 and stats.truncated_fraction == 0.0  # π_θ/π_prox = 1: PPO's clip idle
    assert stats.ratio_mean == pytest.approx((0.5 + 1.0 + 3.0) / 3)  # still the trainer/rollout ratio


def test_tis_differs_from_today_where_the_clip_would_drop_a_token() -> None:
    lp, rollout = _tokens([[1.5]])  # ratio beyond 1 + ε with A > 0: today's clip gives no gradient
    today, _, _ = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 1))
    tis, _, _ = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 1),
                                correction=CorrectionSettings(offpolicy_correction="tis"))
    assert _grad(today, lp).item() == 0.0
    assert _grad(tis, lp).item() == pytest.approx(-1.5)


def test_icepop_drops_tokens_outside_the_band_and_keeps_the_denominator() -> None:
    lp, rollout = _tokens([[0.25, 1.0, 3.0, 8.0]])
    cfg = CorrectionSettings(offpolicy_correction="icepop", icepop_band=(0.5, 5.0))
    loss, _, c = corrected_loss(lp, rollout, torch.tensor([-1.0]), torch.ones(1, 4), correction=cfg)
    assert loss.item() == pytest.approx((1.0 + 3.0) / 4)  # n stays 4
    assert torch.allclose(_grad(loss, lp), torch.tensor([[0.0, 0.25, 0.75, 0.0]], dtype=torch.float64))
    assert (c.masked, c.clipped, c.masked_fraction) == (2, 0, 0.5)
    assert c.ess == pytest.approx(_ess([0.0, 1.0, 3.0, 0.0]))


def test_geo_mask_drops_whole_samples_by_their_geometric_mean() -> None:
    # row 0: geo 1.1, kept; row 1: geo sqrt(8) ~ 2.83, dropped though its token at 2 is inside the band;
    # row 2: geo 1, kept though its tokens are at 0.9 and 1/0.9
    lp, rollout = _tokens([[1.1, 1.1], [4.0, 2.0], [0.9, 1 / 0.9]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    cfg = CorrectionSettings(offpolicy_correction="geo_mask", geo_mask_band=(0.5, 2.0))
    loss, stats, c = corrected_loss(lp, rollout, adv, torch.ones(3, 2), correction=cfg)
    # kept rows go through today's objective: all four ratios are inside PPO's trust region
    objective = 1.1 + 1.1 - 0.9 - 1 / 0.9
    assert loss.item() == pytest.approx(-objective / 6)
    expected = torch.tensor([[-1.1 / 6, -1.1 / 6], [0.0, 0.0], [0.9 / 6, (1 / 0.9) / 6]], dtype=torch.float64)
    assert torch.allclose(_grad(loss, lp), expected)
    assert (c.tokens, c.masked, c.clipped) == (6, 2, 0)
    assert c.ess == pytest.approx(_ess([1.1, 1.1, 0.0, 0.0, 0.9, 1 / 0.9]))
    assert stats.trained_tokens == 6 and stats.clip_fraction == 0.0


def test_geo_mask_keeps_todays_clips_on_the_samples_it_keeps() -> None:
    lp, rollout = _tokens([[1.5, 1.5]])  # geo 1.5: kept; ratio above 1 + ε with A > 0: clipped as today
    cfg = CorrectionSettings(offpolicy_correction="geo_mask")
    loss, stats, _ = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 2), correction=cfg)
    today, today_stats = ppo_clip_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(today.item())
    assert stats.clip_fraction == today_stats.clip_fraction == 1.0


def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_fits() -> None:
    log_ratios = [0.0, 0.1, -0.2, 0.5, -1.0]  # squares 0, .01, .04, .25, 1: prefix means 0, .005, .0167, .075
    lp, rollout = _tokens([[math.exp(x) for x in log_ratios]])
    cfg = CorrectionSettings(offpolicy_correction="m2po", m2po_threshold=0.04)
    loss, _, c = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 5), correction=cfg)
    w = [1.0, math.exp(0.1), math.exp(-0.2), 0.0, 0.0]
    assert loss.item() == pytest.approx(-sum(w) / 5)
    assert torch.allclose(_grad(loss, lp), torch.tensor([[-x / 5 for x in w]], dtype=torch.float64))
    assert (c.masked, c.clipped) == (2, 0)
    assert c.ess == pytest.approx(_ess(w))


def test_m2po_cutoff_by_hand() -> None:
    sq = torch.tensor([0.0, 0.01, 0.04, 0.25, 1.0], dtype=torch.float64)
    assert m2po_cutoff(sq, 0.04) == pytest.approx((0.04 + 0.25) / 2)
    assert m2po_cutoff(sq, 10.0) == math.inf  # nothing removed
    assert m2po_cutoff(torch.tensor([1.0, 2.0]), 0.5) == -math.inf  # even the smallest is too large
    assert m2po_cutoff(torch.zeros(0), 0.04) == math.inf
    # equal values go together: keeping one 0.1 would fit (mean .05), but not both
    assert m2po_cutoff(torch.tensor([0.1, 0.0, 0.1], dtype=torch.float64), 0.05) == pytest.approx(0.05)


def test_m2po_takes_a_given_batch_cutoff() -> None:
    lp, rollout = _tokens([[1.0, math.exp(0.3)]])
    cfg = CorrectionSettings(offpolicy_correction="m2po", m2po_threshold=0.04)
    own, _, c_own = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 2), correction=cfg)
    given_, _, c_given = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.ones(1, 2), correction=cfg,
                                        batch_statistic=1.0)
    assert c_own.masked == 1 and c_given.masked == 0
    assert given_.item() < own.item()


def test_decoupled_clips_current_over_proximal_and_weights_proximal_over_behaviour() -> None:
    # per token: π_prox/μ = 3, 0.5, 1 (weights 2 (truncated), 0.5, 1); π_θ/π_prox = 1.1, 1.5, 0.7
    behaviour = torch.full((1, 3), -1.0, dtype=torch.float64)
    proximal = behaviour + torch.log(torch.tensor([[3.0, 0.5, 1.0]], dtype=torch.float64))
    lp = (proximal + torch.log(torch.tensor([[1.1, 1.5, 0.7]], dtype=torch.float64))).requires_grad_(True)
    cfg = CorrectionSettings(offpolicy_correction="decoupled", tis_cap=2.0)
    loss, stats, c = corrected_loss(lp, behaviour, torch.tensor([1.0]), torch.ones(1, 3), correction=cfg,
                                    clip_eps=0.2, proximal_logprobs=proximal)
    # objectives: 2·1.1; 0.5·min(1.5, 1.2) (clipped: no gradient); 1·0.7
    assert loss.item() == pytest.approx(-(2.2 + 0.6 + 0.7) / 3)
    assert torch.allclose(_grad(loss, lp), torch.tensor([[-2.2 / 3, 0.0, -0.7 / 3]], dtype=torch.float64))
    assert stats.clip_fraction == pytest.approx(1 / 3)
    assert (c.masked, c.clipped) == (0, 1)
    assert c.ess == pytest.approx(_ess([2.0, 0.5, 1.0]))


def test_decoupled_with_one_update_per_batch_is_tis() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 6, 4)
    rollout = torch.log_softmax(logits + torch.randn(3, 6, 4), -1)[..., 0]
    adv, mask = torch.randn(3), torch.rand(3, 6) > 0.2
    results = []
    for kind in ("tis", "decoupled"):
        x = logits.clone().requires_grad_(True)
        loss, stats, c = corrected_loss(torch.log_softmax(x, -1)[..., 0], rollout, adv, mask,
                                        correction=CorrectionSettings(offpolicy_correction=kind))
        results.append((loss, _grad(loss, x), stats, c))
    (la, ga, sa, ca), (lb, gb, sb, cb) = results
    assert torch.equal(la, lb) and torch.equal(ga, gb) and sa == sb and ca == cb


# ------------------------------------------------------------------ empty and all-masked batches


@pytest.mark.parametrize("kind", list(CORRECTIONS))
@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_empty_batch_gives_zero_loss_and_gradient(kind: str, shape: tuple[int, int]) -> None:
    lp = torch.zeros(shape, requires_grad=True)
    loss, stats, c = corrected_loss(lp, torch.zeros(shape), torch.zeros(shape[0]), torch.zeros(shape),
                                    correction=CorrectionSettings(offpolicy_correction=kind))
    assert loss.item() == 0.0 and torch.equal(_grad(loss, lp), torch.zeros(shape))
    assert stats.trained_tokens == 0 and c.ess is None and c.masked_fraction == 0.0


@pytest.mark.parametrize("kind", list(CORRECTIONS))
def test_no_trained_token_gives_zero_loss_and_gradient_even_with_nan_around(kind: str) -> None:
    lp = torch.tensor([[float("nan"), -1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[float("inf"), -9.0, 0.0]])
    loss, _, c = corrected_loss(lp, rollout, torch.tensor([1.0]), torch.zeros(1, 3),
                                correction=CorrectionSettings(offpolicy_correction=kind))
    grad = _grad(loss, lp)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(1, 3))
    assert c.tokens == 0 and c.ess is None


@pytest.mark.parametrize(
    "cfg",
    [
        CorrectionSettings(offpolicy_correction="icepop", icepop_band=(0.9, 1.1)),
        CorrectionSettings(offpolicy_correction="geo_mask", geo_mask_band=(0.9, 1.1)),
        CorrectionSettings(offpolicy_correction="m2po", m2po_threshold=0.01),
    ],
)
def test_every_token_masked_gives_zero_loss_and_gradient(cfg: CorrectionSettings) -> None:
    lp, rollout = _tokens([[3.0, 4.0], [0.2, 0.5]])
    loss, stats, c = corrected_loss(lp, rollout, torch.tensor([1.0, -1.0]), torch.ones(2, 2), correction=cfg)
    grad = _grad(loss, lp)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert (c.tokens, c.masked, c.masked_fraction, c.ess) == (4, 4, 1.0, 0.0)
    assert stats.trained_tokens == 4


# ------------------------------------------------------------------ config and stats


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offpolicy_correction": "nope"}, "unknown correction"),
        ({"tis_cap": 0.9}, "tis_cap"),
        ({"tis_cap": float("nan")}, "tis_cap"),
        ({"icepop_band": (1.2, 5.0)}, "icepop_band"),
        ({"geo_mask_band": (0.5, 0.9)}, "geo_mask_band"),
        ({"geo_mask_band": (-0.1, 2.0)}, "geo_mask_band"),
        ({"m2po_threshold": 0.0}, "m2po_threshold"),
    ],
)
def test_config_rejects_bad_knobs(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CorrectionSettings(**kwargs)  # type: ignore[arg-type]


def test_stats_add_up_over_micro_batches() -> None:
    a = CorrectionStats(tokens=3, masked=1, clipped=0, weight_sum=2.0, weight_sq_sum=2.0)
    b = CorrectionStats(tokens=1, masked=0, clipped=1, weight_sum=2.0, weight_sq_sum=4.0)
    total = a + b
    assert (total.tokens, total.masked, total.clipped) == (4, 1, 1)
    assert total.masked_fraction == 0.25 and total.clipped_fraction == 0.25
    assert total.ess == pytest.approx(16 / (4 * 6))
    assert CorrectionStats().ess is None


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="must all be"):
        corrected_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="proximal_logprobs"):
        corrected_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2),
                       correction=CorrectionSettings(offpolicy_correction="decoupled"),
                       proximal_logprobs=torch.zeros(1, 3))


# ------------------------------------------------------------------ properties

kinds = st.sampled_from(list(CORRECTIONS))
seeds = st.integers(0, 2**16)
dims = st.tuples(st.integers(1, 4), st.integers(1, 6))


def _random(seed: int, shape: tuple[int, int], spread: float) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    rollout = logprobs + spread * torch.randn(shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(shape[0], generator=gen, dtype=torch.float64)
    mask = torch.rand(shape, generator=gen) > 0.3
    return logprobs, rollout, adv, mask


@settings(max_examples=60, deadline=None)
@given(kinds, seeds, dims)
def test_on_policy_every_correction_is_plain_ppo(kind: str, seed: int, shape: tuple[int, int]) -> None:
    logprobs, _, adv, mask = _random(seed, shape, 0.0)
    a = logprobs.clone().requires_grad_(True)
    b = logprobs.clone().requires_grad_(True)
    loss, _, c = corrected_loss(a, logprobs, adv, mask, correction=CorrectionSettings(offpolicy_correction=kind))
    plain, _ = ppo_clip_loss(b, logprobs, adv, mask)
    assert loss.item() == pytest.approx(plain.item(), abs=1e-12)
    assert torch.allclose(_grad(loss, a), _grad(plain, b), atol=1e-12)
    assert c.masked == 0 and c.clipped == 0
    assert c.ess == (1.0 if c.tokens else None)


@settings(max_examples=80, deadline=None)
@given(kinds, seeds, dims, st.floats(0.0, 3.0))
def test_corrections_only_remove_tokens_and_weights_stay_in_bounds(
    kind: str, seed: int, shape: tuple[int, int], spread: float
) -> None:
    logprobs, rollout, adv, mask = _random(seed, shape, spread)
    cfg = CorrectionSettings(offpolicy_correction=kind)
    log_ratio = behaviour_log_ratio(logprobs, rollout, mask)
    if kind in WEIGHTED:
        weighting = CORRECTIONS[kind].weigh(cfg, Ratios(log_ratio, mask))
        w, stays, clipped = weighting.weight, weighting.stays, weighting.clipped
        assert w is not None and not (stays & ~mask).any()
        assert clipped is None or not (clipped & ~mask).any()
        assert (w >= 0).all() and (w[~stays] == 0).all()
        if kind in ("tis", "decoupled"):
            assert (w <= cfg.tis_cap).all() and torch.equal(stays, mask)
        if kind == "icepop":
            k = torch.exp(log_ratio)
            assert torch.equal(stays, mask & (k >= 0.5) & (k <= 5.0))
    if kind == "geo_mask":
        rows = geo_mask_rows(log_ratio, mask, cfg.geo_mask_band)
        assert rows.shape == (shape[0],)
    x = logprobs.clone().requires_grad_(True)
    loss, _, c = corrected_loss(x, rollout, adv, mask, correction=cfg)
    grad = _grad(loss, x)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()  # nothing outside the mask moves
    assert 0 <= c.masked <= c.tokens == int(mask.sum())
    assert c.ess is None or 0.0 <= c.ess <= 1.0


squares = st.lists(st.floats(0.0, 4.0, allow_nan=False), max_size=30)


@settings(max_examples=200, deadline=None)
@given(squares, st.floats(1e-4, 1.0))
def test_m2po_cutoff_keeps_the_largest_set_whose_mean_fits(values: list[float], threshold: float) -> None:
    sq = torch.tensor(values, dtype=torch.float64)
    cutoff = m2po_cutoff(sq, threshold)
    kept = sorted(v for v in values if v <= cutoff)
    removed = sorted(v for v in values if v > cutoff)
    if kept:
        assert sum(kept) / len(kept) <= threshold * (1 + 1e-12)
    if removed:  # the next group of equal values would not fit
        nxt = [v for v in removed if v == removed[0]]
        assert (sum(kept) + sum(nxt)) / (len(kept) + len(nxt)) > threshold * (1 - 1e-12)
        assert not kept or max(kept) < removed[0]
