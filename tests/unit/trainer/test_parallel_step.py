"""Data-parallel steps (``services/trainer/parallel.py``): two ``gloo`` ranks on loopback, each scoring its shard
of the same batch, end every step with the weights, optimizer state and statistics of one rank stepping on the
whole batch (within float summation order), under every off-policy correction and with a rank whose shard is
empty. Real ``torch.distributed`` processes, no stand-in."""

from __future__ import annotations

import datetime
import io
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ops.local.ports import free_port
from services.trainer.corrections import CORRECTIONS
from services.trainer.loss_settings import LossSettings
from services.trainer.parallel import TorchRanks
from services.trainer.samples import BatchSamples, Sample
from services.trainer.step import PolicyTrainer
from shared.policy import PolicyConfig, init_policy, token_logprobs

CFG = PolicyConfig(vocab_size=16, context=16, width=16, layers=1, heads=2)
CPU = torch.device("cpu")
DRIFT = [0.0, 0.3, -1.5, 0.8, 0.05, -0.2]
TOLERANCE = 1e-5
"""On weights after steps of lr 1e-2: measured at most 2e-6, on the attention's key bias, whose gradient is
zero but for float noise that AdamW scales up to a full step (the summation order differs across ranks)."""


def _batch(rewards: list[float]) -> BatchSamples:
    """One sample per reward (two groups when there are 4 or more), rollout logprobs drifted off the model's."""
    model = init_policy(CFG, 0)
    samples = []
    for i, _ in enumerate(rewards):
        ids = [1, 2 + i % 5, 3, 4 + i % 7, 5, 6 + i % 3]
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0].tolist()  # type: ignore[arg-type]
        rollout = [0.0, *(x + DRIFT[(i + j) % len(DRIFT)] for j, x in enumerate(lp))]
        samples.append(Sample(token_ids=ids, loss_mask=[0, 0, 1, 1, 1, 1], rollout_logprobs=rollout,
                              trajectory=i, segment_index=0, session_id=f"s{i}"))
    groups = [0] * len(rewards) if len(rewards) < 4 else [i * 2 // len(rewards) for i in range(len(rewards))]
    return BatchSamples(samples=samples, rewards=rewards, trajectory_group=groups, groups=max(groups) + 1)


def _train(trainer: PolicyTrainer, batches: list[BatchSamples]) -> dict[str, Any]:
    stats = [trainer.step(batch) for batch in batches]
    return {
        "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "moments": [s["exp_avg_sq"].clone() for s in trainer.optimizer.state.values()],
        "stats": [(s.loss, s.grad_norm, s.trained_tokens, s.clip_fraction, s.offpolicy_masked_fraction, s.skipped)
                  for s in stats],
    }


Case = tuple[LossSettings, list[BatchSamples]]


def _cases() -> dict[str, Case]:
    """Each correction on two batches with signal, and a batch whose one sample leaves rank 1's shard empty."""
    cases: dict[str, Case] = {
        kind: (LossSettings(lr=1e-2, offpolicy_correction=kind, m2po_threshold=0.3),
               [_batch([1.0, 0.0, 0.5, 0.0, 0.2]), _batch([0.0, 1.0, 1.0])])
        for kind in CORRECTIONS
    }
    full = _batch([1.0, 0.0])
    cases["empty_shard"] = (LossSettings(lr=1e-2), [BatchSamples(samples=full.samples[:1], rewards=[1.0, 0.0],
                                                         trajectory_group=[0, 0], groups=1)])
    return cases


def _rank(rank: int, world: int, port: int, cases: dict[str, Case], out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        ranks = TorchRanks()
        results = {name: _train(PolicyTrainer(init_policy(CFG, 0), hyper, CPU, ranks=ranks), batches)
                   for name, (hyper, batches) in cases.items()}
        buffer = io.BytesIO()
        torch.save(results, buffer)  # bytes, not shared tensors: those would need this process alive to be read
        out.put((rank, buffer.getvalue()))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    """Every case trained by two ranks (one process group for all: starting one costs seconds)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, _cases(), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {rank: torch.load(io.BytesIO(data)) for rank, data in (out.get(timeout=180) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [results[0], results[1]]


def _close(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name, tensor in a["weights"].items():
        assert torch.allclose(tensor, b["weights"][name], atol=TOLERANCE, rtol=0), name
    for x, y in zip(a["moments"], b["moments"], strict=True):
        assert torch.allclose(x, y, atol=TOLERANCE, rtol=1e-5)
    for x, y in zip(a["stats"], b["stats"], strict=True):
        assert x[2:3] == y[2:3] and x[5] == y[5], (x, y)  # tokens and skip reason exactly
        for u, v in zip(x[:2] + x[3:5], y[:2] + y[3:5], strict=True):
            assert (u is None and v is None) or math.isclose(u, v, rel_tol=1e-5, abs_tol=1e-7), (x, y)


@pytest.mark.parametrize("name", [*CORRECTIONS, "empty_shard"])
def test_two_ranks_take_the_one_rank_step(name: str, two_ranks: list[dict[str, dict[str, Any]]]) -> None:
    hyper, batches = _cases()[name]
    alone = _train(PolicyTrainer(init_policy(CFG, 0), hyper, CPU), batches)
    _close(two_ranks[0][name], two_ranks[1][name])  # the ranks agree with each other ...
    _close(alone, two_ranks[0][name])  # ... and with one rank on the whole batch
    assert all(s[5] is None for s in alone["stats"]), "every batch carried signal: real updates were compared"
