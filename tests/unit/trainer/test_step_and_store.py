"""One optimizer step on the tiny policy, and the durable-step files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.trainer.samples import BatchSamples, Sample
from services.trainer.settings import TrainerSettings
from services.trainer.step import Hyper, PolicyTrainer
from services.trainer.store import MetricsLog, checkpoint_path, latest, reconcile_metrics, save_step, sidecar_path
from shared.model import TinyFamily
from shared.policy import PolicyConfig, init_policy, token_logprobs
from shared.settings import SettingsError, load

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
    trainer = PolicyTrainer(model, Hyper(lr=1e-2, weight_decay=0.0), torch.device("cpu"))
    batch = _batch(model, [1.0, 0.0])
    before = [sum(token_logprobs(model, torch.tensor([s.token_ids]))[0, 1:].tolist()) for s in batch.samples]
    stats = trainer.step(batch)
    after = [sum(token_logprobs(model, torch.tensor([s.token_ids]))[0, 1:].tolist()) for s in batch.samples]
    assert stats.updated and stats.trained_tokens == 6
    assert stats.train_rollout_logprob_abs_diff == pytest.approx(0.0, abs=1e-5)  # rollout = current weights
    assert after[0] > before[0] and after[1] < before[1]


def test_micro_batches_give_the_same_update() -> None:
    """Compared on the gradient the optimizer stepped with (the step leaves it on the parameters): AdamW
    divides by its own scale, so a gradient that is 0 in exact arithmetic (attention's key bias) turns its
    fp32 rounding noise into a step of ~lr, and the weights after it would compare rounding, not the update."""
    a, b = init_policy(CFG, 0), init_policy(CFG, 0)
    batch = _batch(a, [1.0, 0.0, 0.5])
    PolicyTrainer(a, Hyper(micro_batch_size=0), torch.device("cpu")).step(batch)
    PolicyTrainer(b, Hyper(micro_batch_size=1), torch.device("cpu")).step(batch)
    assert any(not torch.equal(pa, p0) for pa, p0 in zip(a.parameters(), init_policy(CFG, 0).parameters(), strict=True))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None
        assert torch.allclose(pa.grad, pb.grad, atol=1e-7)


def test_batch_without_trained_tokens_takes_no_update() -> None:
    model = init_policy(CFG, 0)
    before = [p.clone() for p in model.parameters()]
    stats = PolicyTrainer(model, Hyper(), torch.device("cpu")).step(BatchSamples())
    assert not stats.updated
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters(), strict=True))


def test_save_and_resume_newest_durable_step(tmp_path: Path) -> None:
    model = init_policy(CFG, 0)
    trainer = PolicyTrainer(model, Hyper(), torch.device("cpu"))
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
    log.append([{"step": 1}])
    with log.path.open("a") as fh:
        fh.write('{"step": 2, "lo')  # crash mid-append
    side = save_step(tmp_path, FAMILY, init_policy(CFG, 0), 3, 2, None, [{"step": 2}, {"step": 3}])
    assert reconcile_metrics(log, side) == 2
    assert [json.loads(x)["step"] for x in log.path.read_text().splitlines()] == [1, 2, 3]
    assert reconcile_metrics(log, side) == 0


def test_settings_validation() -> None:
    assert load(TrainerSettings).lr == 1e-3
    with pytest.raises(SettingsError, match="REIN_IS_TRUNCATION"):
        load(TrainerSettings, is_truncation=1.1)
    with pytest.raises(SettingsError, match="REIN_NO_SUCH"):
        load(TrainerSettings, no_such=1)
