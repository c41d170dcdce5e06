"""The off-policy correction through the trainer: settings, PolicyTrainer.step and the step record."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.trainer.corrections import CORRECTIONS, CorrectionSettings
from services.trainer.loss import grpo_advantages, ppo_clip_loss
from services.trainer.loss_settings import LossSettings
from services.trainer.metrics import TrainerMetrics, step_line
from services.trainer.samples import BatchSamples, Sample
from services.trainer.settings import TrainerSettings
from services.trainer.step import PolicyTrainer, collate
from shared.policy import PolicyConfig, init_policy, token_logprobs
from shared.schemas import BatchManifest, GapInfo, GroupRef, WindowInfo
from shared.settings import SettingsError, load

CFG = PolicyConfig(vocab_size=16, context=16, width=16, layers=1, heads=2)
CPU = torch.device("cpu")


def _batch(model: torch.nn.Module, rewards: list[float], drift: list[list[float]]) -> BatchSamples:
    """One sample per reward; ``drift[i]`` is added to the rollout logprobs of sample i's three trained
    tokens, so log(π/μ) = −drift there (stale or mismatched sampling)."""
    samples = []
    for i, _ in enumerate(rewards):
        ids = [1, 2 + i, 3, 4 + i, 5]
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0].tolist()  # type: ignore[arg-type]
        rollout = [0.0, *lp]
        for j, d in enumerate(drift[i]):
            rollout[2 + j] += d
        samples.append(Sample(token_ids=ids, loss_mask=[0, 0, 1, 1, 1], rollout_logprobs=rollout,
                              trajectory=i, segment_index=0, session_id=f"s{i}"))
    return BatchSamples(samples=samples, rewards=rewards, trajectory_group=[0] * len(rewards), groups=1)


DRIFT = [[0.0, 0.0, 0.0], [0.1, -0.2, 0.3], [-1.5, 0.8, 0.05]]


def test_default_step_is_todays_update() -> None:
    """Correction ``none`` takes exactly the update the trainer took before corrections existed."""
    a, b = init_policy(CFG, 0), init_policy(CFG, 0)
    batch = _batch(a, [1.0, 0.0, 0.5], DRIFT)
    PolicyTrainer(a, LossSettings(), CPU).step(batch)
    # the step as it was: one forward, ppo_clip_loss on the whole batch, clip, AdamW
    h = LossSettings()
    optimizer = torch.optim.AdamW(b.parameters(), lr=h.lr, betas=h.betas, weight_decay=h.weight_decay)
    adv = grpo_advantages(torch.tensor(batch.rewards), torch.tensor(batch.trajectory_group))
    t = collate(batch.samples, adv, CPU)
    b.train()
    loss, _ = ppo_clip_loss(token_logprobs(b, t["ids"]), t["rollout"], t["adv"], t["mask"],
                            clip_eps=h.ppo_clip, is_truncation=h.is_truncation, normalizer=float(batch.trained_tokens))
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(b.parameters(), h.grad_clip)
    optimizer.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("kind", list(CORRECTIONS))
def test_micro_batches_give_the_same_update_under_every_correction(kind: str) -> None:
    a, b = init_policy(CFG, 0), init_policy(CFG, 0)
    batch = _batch(a, [1.0, 0.0, 0.5], DRIFT)
    whole = PolicyTrainer(a, LossSettings(micro_batch_size=0, offpolicy_correction=kind, m2po_threshold=0.3),
                          CPU).step(batch)
    parts = PolicyTrainer(b, LossSettings(micro_batch_size=1, offpolicy_correction=kind, m2po_threshold=0.3),
                          CPU).step(batch)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)
    assert parts.offpolicy_masked_fraction == whole.offpolicy_masked_fraction
    assert parts.offpolicy_clipped_fraction == whole.offpolicy_clipped_fraction
    assert parts.offpolicy_ess == pytest.approx(whole.offpolicy_ess)
    assert parts.loss == pytest.approx(whole.loss, abs=1e-6)


def test_m2po_applies_the_whole_batchs_cutoff_to_each_micro_batch() -> None:
    # squared log-ratios: sample 0: 0, 0, 0; sample 1: .01, .04, .09. The batch's mean (.0233) fits τ = .04,
    # so nothing goes; sample 1's drift alone (mean .0467) would lose its .09 tokens.
    model = init_policy(CFG, 0)
    batch = _batch(model, [1.0, 0.0], [[0.0, 0.0, 0.0], [0.1, 0.2, 0.3]])
    cfg = LossSettings(offpolicy_correction="m2po", m2po_threshold=0.04)
    stats = PolicyTrainer(model, cfg.model_copy(update={"micro_batch_size": 1}), CPU).step(batch)
    assert stats.offpolicy_masked_fraction == 0.0
    alone = _batch(init_policy(CFG, 0), [1.0, 0.0], [[0.1, 0.2, 0.3]] * 2)  # two of sample 1 (a group needs a spread)
    alone_stats = PolicyTrainer(init_policy(CFG, 0), cfg, CPU).step(alone)
    assert alone_stats.offpolicy_masked_fraction == pytest.approx(1 / 3)


def test_step_reports_what_the_correction_did_in_the_metrics_line() -> None:
    model = init_policy(CFG, 0)
    batch = _batch(model, [1.0, 0.0, 0.5], DRIFT)  # one token at π/μ = e^1.5 > 2: truncated by TIS
    stats = PolicyTrainer(model, LossSettings(offpolicy_correction="tis"), CPU).step(batch)
    assert stats.offpolicy_clipped_fraction == pytest.approx(1 / 9)
    assert stats.offpolicy_masked_fraction == 0.0
    assert stats.offpolicy_ess is not None and 0.5 < stats.offpolicy_ess < 1.0
    manifest = BatchManifest(
        batch_id="b0", index=0, groups=[GroupRef(group_id="g", partition=0, offset=0)],
        window=WindowInfo(keep_versions=2, current_version="v0", current_index=0, cutoff_index=0),
        version_gap=GapInfo(min=0, max=0, mean=0.0), drops_in_batch=0, drops_cumulative=0,
    )
    line = step_line(step=1, manifest=manifest, batch=batch, stats=stats, bad_refs=0, step_time_s=0.1,
                     fetch_time_s=0.0, correction="tis")
    assert line["offpolicy_correction"] == "tis"
    assert line["offpolicy_clipped_fraction"] == stats.offpolicy_clipped_fraction
    assert line["offpolicy_ess"] == stats.offpolicy_ess
    registry = CollectorRegistry()
    TrainerMetrics(registry).observe(line)
    assert registry.get_sample_value("rein_trainer_offpolicy_ess") == stats.offpolicy_ess
    assert registry.get_sample_value("rein_trainer_offpolicy_clipped_fraction") == pytest.approx(1 / 9)
    assert registry.get_sample_value("rein_trainer_offpolicy_masked_fraction") == 0.0


def test_a_batch_without_trained_tokens_reports_no_ess() -> None:
    stats = PolicyTrainer(init_policy(CFG, 0), LossSettings(offpolicy_correction="icepop"), CPU).step(BatchSamples())
    assert not stats.updated and stats.offpolicy_ess is None and stats.offpolicy_masked_fraction == 0.0


def test_the_trainers_settings_are_the_steps() -> None:
    # one declaration per knob: the step reads the trainer's settings object itself
    assert issubclass(TrainerSettings, LossSettings)
    s = load(TrainerSettings)
    assert (s.offpolicy_correction, s.nonlast_version_tokens) == ("none", "mask")
    assert {k: getattr(s, k) for k in LossSettings.model_fields} == LossSettings().model_dump()
    s = load(TrainerSettings, offpolicy_correction="m2po", m2po_threshold=0.1, tis_cap=3.0,
             icepop_band=(0.4, 6.0), geo_mask_band=(0.8, 1.25))
    assert PolicyTrainer(init_policy(CFG, 0), s, CPU).hyper.m2po_threshold == 0.1
    assert {k: getattr(s, k) for k in CorrectionSettings.model_fields} == CorrectionSettings(
        offpolicy_correction="m2po", tis_cap=3.0, icepop_band=(0.4, 6.0), geo_mask_band=(0.8, 1.25),
        m2po_threshold=0.1).model_dump()


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_OFFPOLICY_CORRECTION", "icepop")
    monkeypatch.setenv("REIN_ICEPOP_BAND", "[0.25, 4]")
    monkeypatch.setenv("REIN_NONLAST_VERSION_TOKENS", "weight")
    s = load(TrainerSettings)
    assert (s.offpolicy_correction, s.icepop_band, s.nonlast_version_tokens) == ("icepop", (0.25, 4.0), "weight")


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"offpolicy_correction": "is"}, "REIN_OFFPOLICY_CORRECTION"),
        ({"tis_cap": 0.5}, "REIN_TIS_CAP"),
        ({"m2po_threshold": 0.0}, "REIN_M2PO_THRESHOLD"),
        ({"icepop_band": (1.5, 5.0)}, "REIN_ICEPOP_BAND"),
        ({"geo_mask_band": (0.5, 0.9)}, "REIN_GEO_MASK_BAND"),
        ({"nonlast_version_tokens": "drop"}, "REIN_NONLAST_VERSION_TOKENS"),
    ],
)
def test_bad_correction_settings_fail_at_start(overrides: dict[str, object], variable: str) -> None:
    with pytest.raises(SettingsError, match=variable):
        load(TrainerSettings, **overrides)


def test_the_former_boolean_version_mask_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_MASK_NONLAST_VERSION", "false")
    with pytest.raises(SettingsError, match="REIN_MASK_NONLAST_VERSION"):
        load(TrainerSettings)
