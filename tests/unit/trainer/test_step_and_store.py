"""One optimizer step on the tiny policy, and the durable-step files."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.trainer.loss_settings import LossSettings
from services.trainer.samples import BatchSamples, Sample
from services.trainer.settings import TrainerSettings
from services.trainer.step import PolicyTrainer
from services.trainer.store import (
    MetricsLog,
    advance,
    checkpoint_path,
    latest,
    reconcile_metrics,
    save_step,
    sidecar_path,
)
from shared.model.tiny import TinyFamily
from shared.policy import PolicyConfig, init_policy, token_logprobs
from shared.settings import SettingsError, load
from tests.support.gradients import record_stepped_gradients

CFG = PolicyConfig(vocab_size=16, context=16, width=16, layers=1, heads=2)
FAMILY = TinyFamily(CFG)


def _batch(model: torch.nn.Module, rewards: list[float]) -> BatchSamples:
    samples = []
    for i, _ in enumerate(rewards):
        ids = [1, 2 + i, 3, 4 + i, 5]
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0].tolist()  # type: ignore[arg-type]
        samples.append(Sample(token_ids=ids, loss_mask=[0, 0, 1, 1, 1], rollout_logprobs=[0.0, *lp],
                              trajectory=i, segment_index=0, session_id=f"s{i}"))
    return BatchSamples(samples=samples, rewards=rewards, trajectory_group=[0] * len(rewards), groups=1)


def test_step_moves_likelihood_towards_the_better_trajectory() -> None:
    model = init_policy(CFG, 0)
    trainer = PolicyTrainer(model, LossSettings(lr=1e-2, weight_decay=0.0), torch.device("cpu"))
    batch = _batch(model, [1.0, 0.0])
    before = [sum(token_logprobs(model, torch.tensor([s.token_ids]))[0, 1:].tolist()) for s in batch.samples]
    stats = trainer.step(batch)
    after = [sum(token_logprobs(model, torch.tensor([s.token_ids]))[0, 1:].tolist()) for s in batch.samples]
    assert stats.updated and stats.trained_tokens == 6
    assert stats.train_rollout_logprob_abs_diff == pytest.approx(0.0, abs=1e-5)  # rollout = current weights
    assert after[0] > before[0] and after[1] < before[1]


def test_micro_batches_give_the_same_update() -> None:
    """Compared on the gradient the optimizer stepped with (recorded at the optimizer's step): AdamW
    divides by its own scale, so a gradient that is 0 in exact arithmetic (attention's key bias) turns its
    fp32 rounding noise into a step of ~lr, and the weights after it would compare rounding, not the update."""
    a, b = init_policy(CFG, 0), init_policy(CFG, 0)
    batch = _batch(a, [1.0, 0.0, 0.5])
    whole, micro = PolicyTrainer(a, LossSettings(micro_batch_size=0), torch.device("cpu")), PolicyTrainer(
        b, LossSettings(micro_batch_size=1), torch.device("cpu"))
    stepped = [record_stepped_gradients(whole), record_stepped_gradients(micro)]
    whole.step(batch)
    micro.step(batch)
    assert any(not torch.equal(pa, p0) for pa, p0 in zip(a.parameters(), init_policy(CFG, 0).parameters(), strict=True))
    assert len(stepped[0]) == len(stepped[1]) == 1
    assert any(g.abs().max() > 0 for g in stepped[0][0])
    for ga, gb in zip(stepped[0][0], stepped[1][0], strict=True):
        assert torch.allclose(ga, gb, atol=1e-7)


def test_batch_without_trained_tokens_takes_no_update() -> None:
    model = init_policy(CFG, 0)
    before = [p.clone() for p in model.parameters()]
    stats = PolicyTrainer(model, LossSettings(), torch.device("cpu")).step(BatchSamples())
    assert not stats.updated and stats.skipped == "no_tokens"
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters(), strict=True))


def _state(trainer: PolicyTrainer) -> tuple[list[bytes], bytes]:
    """The weights' bytes and the optimizer state's serialised bytes, to compare exactly."""
    weights = [p.detach().numpy().tobytes() for p in trainer.model.parameters()]
    buffer = io.BytesIO()
    torch.save(trainer.optimizer_state(), buffer)
    return weights, buffer.getvalue()


def _spy_forward(trainer: PolicyTrainer) -> list[int]:
    calls: list[int] = []
    trainer.model.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.0, 0.0], [0.4, 0.4, 0.4, 0.4]])
def test_a_batch_whose_groups_all_have_equal_rewards_leaves_weights_and_optimizer_untouched(
    rewards: list[float],
) -> None:
    """Every advantage is 0: AdamW would still move the weights (momentum, weight decay); it must not step."""
    model = init_policy(CFG, 0)
    trainer = PolicyTrainer(model, LossSettings(), torch.device("cpu"))
    trainer.step(_batch(model, [1.0, 0.0]))  # a real step first: AdamW has momentum to spend
    batch = _batch(model, rewards)
    before = _state(trainer)
    forwards = _spy_forward(trainer)
    stats = trainer.step(batch)
    assert _state(trainer) == before
    assert not stats.updated and stats.skipped == "no_signal"
    assert batch.trained_tokens == 3 * len(rewards)
    assert stats.trained_tokens == 0 and stats.advantage_abs_mean == 0.0  # nothing was trained
    assert forwards == []  # decided before the forward pass: no compute spent on it
    assert stats.loss is None and stats.grad_norm is None


def test_advantages_only_on_untrained_tokens_carry_no_signal() -> None:
    """Group 1 has a spread of rewards, but its samples have no trained token (all version-masked)."""
    model = init_policy(CFG, 0)
    trainer = PolicyTrainer(model, LossSettings(), torch.device("cpu"))
    batch = _batch(model, [0.5, 0.5, 1.0, 0.0])
    batch.trajectory_group, batch.groups = [0, 0, 1, 1], 2
    batch.samples[2:] = [replace(s, loss_mask=[0] * len(s.loss_mask)) for s in batch.samples[2:]]
    before = _state(trainer)
    stats = trainer.step(batch)
    assert stats.skipped == "no_signal" and _state(trainer) == before


def test_a_step_whose_gradient_is_zero_takes_no_update() -> None:
    """Advantages are not 0, but every token's ratio is far out of PPO's clip: the loss has no gradient."""
    model = init_policy(CFG, 0)
    trainer = PolicyTrainer(model, LossSettings(), torch.device("cpu"))
    trainer.step(_batch(model, [1.0, 0.0]))
    batch = _batch(model, [1.0, 0.0])
    batch.samples = [replace(s, rollout_logprobs=[x - 5.0 for x in s.rollout_logprobs]) for s in batch.samples]
    before = _state(trainer)
    stats = trainer.step(batch)
    assert stats.skipped == "zero_gradient" and stats.grad_norm == 0.0 and stats.clip_fraction is not None
    assert stats.trained_tokens == 0 and _state(trainer) == before
    assert all(p.grad is None for p in trainer.model.parameters())


def test_save_and_resume_newest_durable_step(tmp_path: Path) -> None:
    model = init_policy(CFG, 0)
    trainer = PolicyTrainer(model, LossSettings(), torch.device("cpu"))
    save_step(tmp_path, FAMILY, model, 0, -1, trainer.optimizer_state())
    trainer.step(_batch(model, [1.0, 0.0]))
    side = save_step(tmp_path, FAMILY, model, 1, 0, trainer.optimizer_state(), [{"step": 1, "loss": 0.5}])
    checkpoint_path(tmp_path, 2).write_bytes(b"torn")  # checkpoint without sidecar: not durable
    resumed = latest(tmp_path, FAMILY, torch.device("cpu"))
    assert resumed is not None
    assert resumed.sidecar.step == 1 and resumed.sidecar.last_index == 0
    assert resumed.checkpoint.digest == side.digest
    assert resumed.optimizer_state is not None and resumed.optimizer_state["state"]


def test_corrupt_newest_falls_back(tmp_path: Path) -> None:
    model = init_policy(CFG, 0)
    save_step(tmp_path, FAMILY, model, 0, -1, None)
    save_step(tmp_path, FAMILY, model, 1, 0, None)
    checkpoint_path(tmp_path, 1).write_bytes(b"garbage")
    resumed = latest(tmp_path, FAMILY, torch.device("cpu"))
    assert resumed is not None and resumed.sidecar.step == 0
    assert latest(tmp_path / "missing", FAMILY, torch.device("cpu")) is None
    assert json.loads(sidecar_path(tmp_path, 0).read_text())["version"] == "v0"


def test_metrics_reconcile_restores_lost_lines_and_cuts_torn_ones(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append([{"step": 1, "manifest_index": 0}, {"step": 2, "manifest_index": 1}])
    with log.path.open("a") as fh:
        fh.write('{"step": 2, "lo')  # crash mid-append
    # a skipped batch's line keeps the step of the weights held: lines are told apart by manifest index
    lines = [{"step": 2, "manifest_index": 2, "skipped": "no_signal"}, {"step": 3, "manifest_index": 3}]
    side = save_step(tmp_path, FAMILY, init_policy(CFG, 0), 3, 3, None, lines)
    assert reconcile_metrics(log, side) == 2
    assert [json.loads(x)["manifest_index"] for x in log.path.read_text().splitlines()] == [0, 1, 2, 3]
    assert reconcile_metrics(log, side) == 0


def test_advance_makes_skipped_manifests_durable_without_a_new_checkpoint(tmp_path: Path) -> None:
    """Batches consumed without an update move the sidecar's last_index on; the weights stay the same files."""
    model = init_policy(CFG, 0)
    side = save_step(tmp_path, FAMILY, model, 2, 5, None, [{"step": 2, "manifest_index": 5}])
    weights = checkpoint_path(tmp_path, 2).read_bytes()
    skip = {"step": 2, "manifest_index": 6, "skipped": "no_signal"}
    moved = advance(tmp_path, side, 6, [skip])
    assert (moved.step, moved.version, moved.digest) == (2, "v2", side.digest)
    assert (moved.last_index, moved.metrics) == (6, [skip])
    assert checkpoint_path(tmp_path, 2).read_bytes() == weights
    resumed = latest(tmp_path, FAMILY, torch.device("cpu"))
    assert resumed is not None and resumed.sidecar == moved


def test_settings_validation() -> None:
    assert load(TrainerSettings).lr == 1e-3
    with pytest.raises(SettingsError, match="REIN_IS_TRUNCATION"):
        load(TrainerSettings, is_truncation=1.1)
    with pytest.raises(SettingsError, match="REIN_NO_SUCH"):
        load(TrainerSettings, no_such=1)


def test_entropy_bonus_adds_its_gradient_and_reports_the_entropy() -> None:
    """With ``entropy_coef`` the stepped gradient is the policy loss's plus ``-coef`` x the gradient of the
    token-mean entropy; the step reports that entropy (none without the bonus)."""
    coef = 0.5
    plain_model, bonus_model = init_policy(CFG, 0), init_policy(CFG, 0)
    batch = _batch(plain_model, [1.0, 0.0])
    plain = PolicyTrainer(plain_model, LossSettings(weight_decay=0.0, grad_clip=1e9), torch.device("cpu"))
    bonus = PolicyTrainer(bonus_model, LossSettings(weight_decay=0.0, grad_clip=1e9, entropy_coef=coef),
                          torch.device("cpu"))
    stepped = [record_stepped_gradients(plain), record_stepped_gradients(bonus)]

    reference = init_policy(CFG, 0)
    ids = torch.tensor([s.token_ids for s in batch.samples])
    mask = torch.tensor([s.loss_mask for s in batch.samples], dtype=torch.bool)[:, 1:]
    logp = torch.log_softmax(reference(ids)[:, :-1], -1)
    entropy = -(logp.exp() * logp).sum(-1)[mask].mean()
    entropy.backward()  # type: ignore[no-untyped-call]

    assert plain.step(batch).entropy is None
    stats = bonus.step(batch)
    assert stats.updated and stats.entropy == pytest.approx(float(entropy.detach()), rel=1e-5)
    for g_plain, g_bonus, p in zip(stepped[0][0], stepped[1][0], reference.parameters(), strict=True):
        assert p.grad is not None
        assert torch.allclose(g_bonus, g_plain - coef * p.grad, atol=1e-6)


def test_entropy_coef_setting_reaches_the_trainer() -> None:
    trainer = PolicyTrainer(init_policy(CFG, 0), TrainerSettings(entropy_coef=0.003), torch.device("cpu"))
    assert trainer.hyper.entropy_coef == 0.003
    with pytest.raises(ValueError):
        TrainerSettings(entropy_coef=-0.1)


def test_epochs_step_the_batch_again_on_the_moved_weights_and_report_the_first_pass() -> None:
    """``epochs=2`` is the same as stepping the batch twice with ``epochs=1`` (the second pass scores it on the
    weights the first left, against the same rollout logprobs), and its statistics are the first pass's."""
    once, twice = init_policy(CFG, 0), init_policy(CFG, 0)
    batch = _batch(once, [1.0, 0.0, 0.5])
    single = PolicyTrainer(once, LossSettings(lr=1e-2), torch.device("cpu"))
    double = PolicyTrainer(twice, LossSettings(lr=1e-2, epochs=2), torch.device("cpu"))
    first = single.step(batch)
    second = single.step(batch)
    assert second.train_rollout_logprob_abs_diff is not None and second.train_rollout_logprob_abs_diff > 1e-4
    stats = double.step(batch)
    assert stats == first
    assert _state(double) == _state(single)


def test_epochs_take_no_step_on_a_batch_without_signal() -> None:
    model = init_policy(CFG, 0)
    trainer = PolicyTrainer(model, LossSettings(epochs=3), torch.device("cpu"))
    before = _state(trainer)
    assert trainer.step(_batch(model, [0.5, 0.5])).skipped == "no_signal"
    assert _state(trainer) == before


def test_epochs_setting_reaches_the_trainer() -> None:
    assert TrainerSettings().epochs == 1
    assert PolicyTrainer(init_policy(CFG, 0), TrainerSettings(epochs=2), torch.device("cpu")).hyper.epochs == 2
    with pytest.raises(ValueError):
        TrainerSettings(epochs=0)
