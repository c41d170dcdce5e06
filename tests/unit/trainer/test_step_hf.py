"""The trainer on a Hugging Face model: a random tiny Llama with the SmolLM2 tokenizer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from services.engine.settings import EngineSettings
from services.proxy.settings import ProxySettings
from services.trainer.loss_settings import LossSettings
from services.trainer.samples import BatchSamples, Sample
from services.trainer.settings import TrainerSettings
from services.trainer.step import PolicyTrainer
from services.trainer.store import checkpoint_path, latest, optimizer_path, prune, save_step, sidecar_path
from shared.model import load_family
from shared.model.compute import set_gradient_checkpointing, token_logprobs
from shared.model.hf import HFFamily
from shared.settings import load

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def family(tiny_llama_dir: Path) -> HFFamily:
    found = load_family(str(tiny_llama_dir))
    assert isinstance(found, HFFamily)
    return found


def _batch(family: HFFamily, model: torch.nn.Module, rewards: list[float], reply: int = 6) -> BatchSamples:
    tok = family.tokenizer
    samples = []
    for i, _ in enumerate(rewards):
        prompt = tok.encode_chat([{"role": "user", "content": f"What is {i} + {i}?"}], add_generation_prompt=True)
        ids = prompt + [28 + i, 30 + i, 32, 34, 36, 2][:reply]
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0].tolist()
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        samples.append(Sample(token_ids=ids, loss_mask=mask, rollout_logprobs=[0.0, *lp], trajectory=i,
                              segment_index=0, session_id=f"s{i}"))
    return BatchSamples(samples=samples, rewards=rewards, trajectory_group=[0] * len(rewards), groups=1)


def _reply_logprob(model: torch.nn.Module, sample: Sample) -> float:
    with torch.no_grad():
        lp = token_logprobs(model, torch.tensor([sample.token_ids]))[0]
    mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
    return float(lp[mask].sum())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_step_moves_likelihood_towards_the_better_trajectory(family: HFFamily, checkpointing: bool) -> None:
    model = family.new_model(0, CPU, dtype=torch.float32)
    set_gradient_checkpointing(model, checkpointing)
    trainer = PolicyTrainer(model, LossSettings(lr=1e-2, weight_decay=0.0), CPU)
    batch = _batch(family, model, [1.0, 0.0])
    before = [_reply_logprob(model, s) for s in batch.samples]
    stats = trainer.step(batch)
    after = [_reply_logprob(model, s) for s in batch.samples]
    assert stats.updated and stats.trained_tokens == 12
    assert stats.train_rollout_logprob_abs_diff == pytest.approx(0.0, abs=1e-4)  # rollout = current weights
    assert after[0] > before[0] and after[1] < before[1]


def test_bf16_autocast_step_keeps_fp32_weights(family: HFFamily) -> None:
    model = family.new_model(0, CPU, dtype=torch.float32)
    trainer = PolicyTrainer(model, LossSettings(lr=1e-3), CPU, autocast=torch.bfloat16)
    stats = trainer.step(_batch(family, model, [1.0, 0.0]))
    assert stats.updated and 0.0 < stats.train_rollout_logprob_abs_diff < 0.5  # bf16 forward vs fp32 rollout
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_save_resume_and_prune_directory_checkpoints(family: HFFamily, tmp_path: Path) -> None:
    model = family.new_model(0, CPU, dtype=torch.float32)
    trainer = PolicyTrainer(model, LossSettings(), CPU)
    save_step(tmp_path, family, model, 0, -1, trainer.optimizer_state())
    trainer.step(_batch(family, model, [1.0, 0.0]))
    side = save_step(tmp_path, family, model, 1, 0, trainer.optimizer_state(), [{"step": 1}])
    assert checkpoint_path(tmp_path, 1, "").is_dir() and side.path == str(checkpoint_path(tmp_path, 1, "").resolve())
    (tmp_path / "v2").mkdir()  # a checkpoint directory without sidecar: not durable
    resumed = latest(tmp_path, family, CPU, dtype=torch.float32)
    assert resumed is not None and resumed.sidecar.step == 1 and resumed.checkpoint.digest == side.digest
    assert resumed.optimizer_state is not None and resumed.optimizer_state["state"]
    assert family.digest(resumed.checkpoint.model) == family.digest(model)

    save_step(tmp_path, family, model, 3, 2, None)
    assert prune(tmp_path, family, keep=2) == [0]
    assert not checkpoint_path(tmp_path, 0, "").exists() and not sidecar_path(tmp_path, 0).exists()
    assert not optimizer_path(tmp_path, 0).exists() and sidecar_path(tmp_path, 1).exists()
    assert prune(tmp_path, family, keep=0) == []


def test_step_time_on_the_tiny_llama(family: HFFamily, capsys: pytest.CaptureFixture[str]) -> None:
    """8 samples x 128 tokens, the shape of the SmolLM2 figures: prints the time (seconds on 2 cores)."""
    model = family.new_model(0, CPU, dtype=torch.float32)
    trainer = PolicyTrainer(model, LossSettings(lr=1e-4), CPU)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        ids = torch.randint(3, 49152, (128,), generator=gen).tolist()
        samples.append(Sample(token_ids=ids, loss_mask=[0] * 64 + [1] * 64, rollout_logprobs=[-10.0] * 128,
                              trajectory=i, segment_index=0, session_id=f"s{i}"))
    batch = BatchSamples(samples=samples, rewards=[float(i % 2) for i in range(8)], trajectory_group=[0] * 8,
                         groups=1)
    trainer.step(batch)  # warm-up
    started = time.perf_counter()
    stats = trainer.step(batch)
    elapsed = time.perf_counter() - started
    with capsys.disabled():
        print(f"\ntiny Llama trainer step, 8 x 128 tokens: {elapsed:.3f} s")
    assert stats.updated and stats.trained_tokens == 8 * 64
    assert elapsed < 30.0


def test_one_model_setting_for_engine_proxy_and_trainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    required = {ProxySettings: {"admin_token": "a-token-of-8+", "runner_token": "r" * 16,
                                "session_key_secret": "k" * 16, "run_id": "r"}}
    for cls in (EngineSettings, ProxySettings, TrainerSettings):
        assert load(cls, **required.get(cls, {})).model == "tiny"
    monkeypatch.setenv("REIN_MODEL", str(tmp_path))
    for cls in (EngineSettings, ProxySettings, TrainerSettings):
        assert load(cls, **required.get(cls, {})).model == str(tmp_path)
    settings = load(TrainerSettings, precision="bf16", gradient_checkpointing=True, keep_checkpoints=3)
    assert (settings.precision, settings.gradient_checkpointing, settings.keep_checkpoints) == ("bf16", True, 3)
