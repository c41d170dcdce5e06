"""A correction registered in ``CORRECTIONS`` is a trainer setting, a demo choice, a settings-reference row,
and what the loss and the step apply."""

from __future__ import annotations

import pytest
import torch

from services.trainer.corrections import (
    CORRECTIONS,
    Correction,
    CorrectionSettings,
    Ratios,
    Weighting,
    corrected_loss,
)
from services.trainer.loss_settings import LossSettings
from services.trainer.samples import BatchSamples, Sample
from services.trainer.settings import TrainerSettings
from services.trainer.step import PolicyTrainer
from shared.policy import PolicyConfig, init_policy
from tests.support.registry import RegisteredChoice


def capped_mask(cfg: CorrectionSettings, t: Ratios) -> Weighting:
    """Tokens with k above the cap leave the loss; the others keep w = k (docs/architecture.md's example)."""
    k = torch.exp(t.log_ratio)
    stays = t.keep & (k <= cfg.tis_cap)
    return Weighting(stays, torch.where(stays, k, torch.zeros_like(k)))


def drop_all(cfg: CorrectionSettings, t: Ratios) -> Weighting:
    """Every trained token leaves the loss."""
    return Weighting(torch.zeros_like(t.keep))


CORRECTION = RegisteredChoice(TrainerSettings, "offpolicy_correction", "--correction", CORRECTIONS)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both corrections, for one test (monkeypatch removes them after it)."""
    monkeypatch.setitem(CORRECTIONS, "capped_mask", Correction(capped_mask))
    monkeypatch.setitem(CORRECTIONS, "drop_all", Correction(drop_all))


def test_a_registered_correction_is_a_setting_and_a_demo_choice(registered: None) -> None:
    s = CORRECTION.assert_chosen("capped_mask")
    assert isinstance(s, TrainerSettings) and s.offpolicy_correction == "capped_mask"
    assert CorrectionSettings(offpolicy_correction="capped_mask").offpolicy_correction == "capped_mask"
    CORRECTION.assert_chosen("drop_all")
    row = CORRECTION.reference_row()
    assert "`capped_mask`" in row and "`drop_all`" in row


def test_an_unknown_correction_names_every_registered_one(registered: None) -> None:
    CORRECTION.assert_refused("third", "none, tis, icepop, geo_mask, m2po, decoupled, capped_mask, drop_all")


def test_unregistered_after_the_test() -> None:
    CORRECTION.assert_unregistered("capped_mask")


def test_the_loss_applies_a_registered_correction(registered: None) -> None:
    # π/μ = 1 and 3 on the trained tokens: the second is above the cap 2 and leaves the loss
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    rollout = logprobs.detach() - torch.log(torch.tensor([[1.0, 3.0, 1.0]], dtype=torch.float64))
    loss, _, stats = corrected_loss(logprobs, rollout, torch.tensor([1.0]), torch.tensor([[1, 1, 0]]),
                                    correction=CorrectionSettings(offpolicy_correction="capped_mask", tis_cap=2.0))
    assert loss.item() == pytest.approx(-1.0 / 2)  # w·A = 1 on one token, over both trained tokens
    assert (stats.tokens, stats.masked) == (2, 1) and stats.weight_sum == pytest.approx(1.0)


def test_the_step_applies_a_registered_correction(registered: None) -> None:
    model = init_policy(PolicyConfig(vocab_size=16, context=16, width=16, layers=1, heads=2), 0)
    samples = [Sample(token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], rollout_logprobs=[0.0, -2.0, -2.0, -2.0],
                      trajectory=i, segment_index=0, session_id=f"s{i}") for i in range(2)]
    batch = BatchSamples(samples=samples, rewards=[1.0, 0.0], trajectory_group=[0, 0], groups=1)
    before = [p.detach().clone() for p in model.parameters()]
    stats = PolicyTrainer(model, LossSettings(offpolicy_correction="drop_all"), torch.device("cpu")).step(batch)
    assert stats.skipped == "zero_gradient" and stats.offpolicy_masked_fraction == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
