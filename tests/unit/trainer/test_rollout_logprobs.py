"""The engine's logprobs are the trainer's: same weights, same tokens, agreement to 1e-4.

The engine's code path (batched, KV-cached decoding of requests of different lengths, one
aborted and resumed with its partial output as a longer prompt, a weight swap mid-request)
against the trainer's (right-padded micro-batches scored by ``token_logprobs`` before the
update), for the tiny policy and a small Llama.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from services.engine.batcher import Batcher, Request, Weights
from services.engine.sampling import SamplingParams
from services.trainer.loss_settings import LossSettings
from services.trainer.samples import BatchSamples, Sample
from services.trainer.step import PolicyTrainer
from shared.policy import PolicyConfig, init_policy
from shared.schemas import SamplingParams as Recorded

TOL = 1e-4
VOCAB = 50


def tiny(seed: int) -> nn.Module:
    return init_policy(PolicyConfig(vocab_size=VOCAB, context=64, width=32, layers=2, heads=4), seed).eval()


def llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2)  # sharp enough attention that a position or mask slip shows
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


FAMILIES: dict[str, Callable[[int], nn.Module]] = {"tiny": tiny, "llama": llama}


def generate(
    make: Callable[[int], nn.Module], temperature: float, per_request: dict[str, Recorded] | None = None
) -> tuple[list[Sample], dict[str, nn.Module]]:
    """Five requests of different lengths decoded together; ``r1`` aborted after 4 steps and resumed
    (its partial output joins the prompt, as the proxy resends it); v0 -> v1 after 9 steps.
    ``per_request``: a request's own sampling parameters (else ``temperature``, no filter), recorded on
    its sample as a chunk records them. Returns one sample per request (prompt + every sampled token,
    engine logprobs and versions)."""
    models = {"v0": make(0), "v1": make(1)}
    batcher = Batcher(Weights(models["v0"], "v0", "d0", 0, None), end_id=VOCAB - 1, seed=3)
    recorded = {f"r{i}": (per_request or {}).get(f"r{i}", Recorded(temperature=temperature)) for i in range(5)}

    def params(rid: str, budget: int) -> SamplingParams:
        r = recorded[rid]
        return SamplingParams(max_new_tokens=budget, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              ignore_eos=True)

    rng = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(0, VOCAB, (n,), generator=rng).tolist() for i, n in enumerate([3, 9, 5, 17, 1])}
    pieces: dict[str, list[Request]] = {rid: [batcher.admit(rid, p, params(rid, 14))] for rid, p in prompts.items()}
    for i in range(40):
        if i == 4:
            first = pieces["r1"][0]
            batcher.abort("r1")
            resumed = params("r1", 14 - len(first.output_ids))
            pieces["r1"].append(batcher.admit("r1", prompts["r1"] + first.output_ids, resumed))
        if i == 9:
            batcher.swap_weights(Weights(models["v1"], "v1", "d1", 1, None))
        if not batcher.has_work():
            break
        batcher.step()
    assert not batcher.has_work()
    samples = []
    for n, (rid, reqs) in enumerate(pieces.items()):
        out = [t for r in reqs for t in r.output_ids]
        ids = prompts[rid] + out
        samples.append(Sample(
            token_ids=ids, loss_mask=[0] * len(prompts[rid]) + [1] * len(out),
            rollout_logprobs=[0.0] * len(prompts[rid]) + [lp for r in reqs for lp in r.logprobs],
            trajectory=n, segment_index=0, session_id=rid,
            versions=(None,) * len(prompts[rid]) + tuple(v for r in reqs for v in r.versions),
            sampling=(None,) * len(prompts[rid]) + (recorded[rid],) * len(out) if per_request else (),
        ))
    assert len(pieces["r1"][0].output_ids) == 4 and len(samples[1].token_ids) == 9 + 14
    return samples, models


def only(samples: list[Sample], version: str) -> BatchSamples:
    """The samples with only ``version``'s tokens trained (the first token never is)."""
    kept = [Sample(s.token_ids, [int(m == 1 and v == version and t > 0)
                                 for t, (m, v) in enumerate(zip(s.loss_mask, s.versions, strict=True))],
                   s.rollout_logprobs, s.trajectory, s.segment_index, s.session_id, s.versions, s.sampling)
            for s in samples]
    return BatchSamples(samples=kept, rewards=[float(i % 2) for i in range(len(kept))],
                        trajectory_group=[0] * len(kept), groups=1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_equal_the_trainers_on_the_same_weights(family: str, temperature: float) -> None:
    samples, models = generate(FAMILIES[family], temperature)
    for version in ("v0", "v1"):
        batch = only(samples, version)
        assert batch.trained_tokens > 10
        trainer = PolicyTrainer(copy.deepcopy(models[version]),
                                LossSettings(temperature=temperature, micro_batch_size=2), torch.device("cpu"))
        stats = trainer.step(batch, version=version)
        assert stats.train_rollout_logprob_abs_diff < TOL
        assert stats.same_version_tokens == stats.trained_tokens
        assert stats.train_rollout_logprob_abs_diff_same_version is not None
        assert stats.train_rollout_logprob_abs_diff_same_version < TOL


def test_tokens_of_other_weights_are_scored_apart() -> None:
    """Trained on v1 with v0's tokens in the batch: the whole diff is staleness, the same-version part ~0."""
    samples, models = generate(tiny, 1.0)
    batch = only(samples, "v0")
    mixed = [Sample(s.token_ids, [int(t > 0 and v is not None) for t, v in enumerate(s.versions)],
                    s.rollout_logprobs, s.trajectory, s.segment_index, s.session_id, s.versions)
             for s in samples]
    batch.samples = mixed
    v1_tokens = sum(1 for s in mixed for t, v in enumerate(s.versions) if t > 0 and v == "v1")
    stats = PolicyTrainer(copy.deepcopy(models["v1"]), LossSettings(), torch.device("cpu")).step(batch, version="v1")
    assert 0 < stats.same_version_tokens == v1_tokens < stats.trained_tokens
    assert stats.train_rollout_logprob_abs_diff > 0.01
    assert stats.train_rollout_logprob_abs_diff_same_version is not None
    assert stats.train_rollout_logprob_abs_diff_same_version < TOL
    unlabelled = PolicyTrainer(copy.deepcopy(models["v1"]), LossSettings(), torch.device("cpu")).step(batch)
    assert (unlabelled.same_version_tokens, unlabelled.train_rollout_logprob_abs_diff_same_version) == (0, None)


MIXED = {
    "r0": Recorded(temperature=0.7),
    "r1": Recorded(temperature=0.7, top_p=0.9),  # aborted and resumed
    "r2": Recorded(temperature=1.3, top_k=5),
    "r3": Recorded(temperature=0.8, top_k=12, top_p=0.85),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_tokens_own_sampling_parameters_are_scored(family: str) -> None:
    """Sessions that set their own temperature, top-p and top-k, trained by a trainer whose
    ``REIN_TEMPERATURE`` is 1: with the weights that sampled them, trainer and engine agree to 1e-5,
    because each token is scored under the distribution it was drawn from (the chunk records it)."""
    samples, models = generate(FAMILIES[family], 1.0, MIXED)
    for version in ("v0", "v1"):
        batch = only(samples, version)
        assert batch.trained_tokens > 10
        stats = PolicyTrainer(copy.deepcopy(models[version]), LossSettings(micro_batch_size=2),
                              torch.device("cpu")).step(batch, version=version)
        assert stats.same_version_tokens == stats.trained_tokens
        assert stats.train_rollout_logprob_abs_diff_same_version is not None
        assert stats.train_rollout_logprob_abs_diff_same_version <= 1e-5, version


def test_sampling_parameters_unrecorded_fall_back_to_the_trainers_temperature() -> None:
    """Records without sampling parameters (older chunks) are scored at ``LossSettings.temperature``; scoring
    a T = 0.7 rollout at T = 1 is what the parameters on the chunk prevent: a gap that is not staleness."""
    samples, models = generate(tiny, 0.7)
    batch = only(samples, "v0")
    right = PolicyTrainer(copy.deepcopy(models["v0"]), LossSettings(temperature=0.7),
                          torch.device("cpu")).step(batch, "v0")
    wrong = PolicyTrainer(copy.deepcopy(models["v0"]), LossSettings(), torch.device("cpu")).step(batch, "v0")
    good, bad = right.train_rollout_logprob_abs_diff_same_version, wrong.train_rollout_logprob_abs_diff_same_version
    assert good is not None and bad is not None
    assert good < TOL < 0.01 < bad
