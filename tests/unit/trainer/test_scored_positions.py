"""Logits only where the loss reads them: ``token_logprobs(where=mask)`` and the trainer's step built on it
give the full path's logprobs and gradients (to 1e-5), and the LM head really runs on the trained rows only.

Families: the tiny policy, a Llama with its head tied to the embedding and one with its own head (both split
the head off), a Gemma 2 with logit soft-capping and a tiny-policy subclass with its own ``forward`` (both
must take the full path: applying their head alone would give other logits).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from services.trainer.loss_settings import LossSettings
from services.trainer.samples import BatchSamples, Sample
from services.trainer.step import PolicyTrainer
from shared.model.compute import features, logits, token_logprobs
from shared.model.sampling import SamplingTensors
from shared.policy import PolicyConfig, TinyPolicy, init_policy
from shared.schemas import SamplingParams
from tests.support.gradients import record_stepped_gradients

TOL = 1e-5
VOCAB = 300


def tiny() -> nn.Module:
    return init_policy(PolicyConfig(vocab_size=VOCAB, context=64, width=32, layers=2, heads=4), 0)


class Doubled(TinyPolicy):
    """A policy whose ``forward`` is not ``head(hidden)``: logits twice the head's."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(ids)


def doubled() -> nn.Module:
    torch.manual_seed(0)
    return Doubled(PolicyConfig(vocab_size=VOCAB, context=64, width=32, layers=2, heads=4))


def llama(tied: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          initializer_range=0.2, tie_word_embeddings=tied)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
        return model

    return make


def gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                       initializer_range=0.2, final_logit_softcapping=2.0)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(cfg)


FAMILIES: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "tiny": (tiny, True),
    "llama-tied": (llama(True), True),
    "llama-untied": (llama(False), True),
    "gemma2-softcap": (gemma2, False),
    "tiny-own-forward": (doubled, False),
}
"""Name -> (model, whether its head is split off)."""


def head_module(model: nn.Module) -> nn.Module:
    head = model.head if isinstance(model, TinyPolicy) else model.get_output_embeddings()  # type: ignore[operator]
    assert isinstance(head, nn.Module)
    return head


def head_rows(model: nn.Module, run: Callable[[], object]) -> list[int]:
    """Rows (positions) the head computes logits for in each of its calls during ``run``."""
    seen: list[int] = []
    hook = head_module(model).register_forward_hook(lambda _m, args, _o: seen.append(args[0][..., 0].numel()))
    try:
        run()
    finally:
        hook.remove()
    return seen


def batch_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SamplingTensors]:
    """ids ``[3, 40]``; ``where`` (two reply spans per row, a fraction of the positions); ``adv`` per row;
    mixed sampling parameters (temperature, top-k, top-p and none) per position."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 40), generator=gen)
    where = torch.zeros(3, 39, dtype=torch.bool)
    where[0, 10:16] = where[0, 30:39] = True
    where[1, 5:9] = where[1, 20:24] = True
    where[2, 37:39] = True
    temperature = torch.rand(3, 39, generator=gen) + 0.5
    top_k = torch.where(torch.rand(3, 39, generator=gen) < 0.3, torch.randint(2, 40, (3, 39), generator=gen), -1)
    top_p = torch.where(torch.rand(3, 39, generator=gen) < 0.3, torch.rand(3, 39, generator=gen) * 0.5 + 0.5, 1.0)
    return ids, where, torch.tensor([1.0, -0.5, 0.25]), SamplingTensors(temperature, top_k, top_p)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("sampled", [False, True], ids=["plain", "sampling"])
@pytest.mark.parametrize("name", FAMILIES)
def test_scoring_where_asked_equals_the_full_path(name: str, sampled: bool) -> None:
    make, split = FAMILIES[name]
    ids, where, adv, sampling = batch_tensors()
    params = sampling if sampled else None
    results = []
    for scored in (None, where):
        model = make().train()
        lp = token_logprobs(model, ids, 0.8, sampling=params, where=scored)
        (-(adv[:, None] * torch.where(where, lp, 0.0)).sum()).backward()
        results.append((lp.detach(), grads(model)))
    (full, full_grads), (part, part_grads) = results
    assert part.shape == full.shape == where.shape
    assert (part[~where] == 0).all()
    assert (part[where] - full[where]).abs().max() <= TOL
    assert any(g.abs().max() > 1e-3 for g in full_grads)
    for a, b in zip(full_grads, part_grads, strict=True):
        assert (a - b).abs().max() <= TOL

    model = make()
    rows = head_rows(model, lambda: token_logprobs(model, ids, sampling=params, where=where))
    assert rows == ([int(where.sum())] if split else [ids.numel()])


def test_the_full_path_families_would_differ_under_their_head_alone() -> None:
    """Why Gemma 2 and an overridden ``forward`` must not be split: their head alone gives other logits."""
    ids = batch_tensors()[0]
    with torch.no_grad():
        for make in (gemma2, doubled):
            model = make().eval()
            head_alone = head_module(model)(model.model(input_ids=ids).last_hidden_state if make is gemma2
                                             else model.hidden(ids))
            assert not torch.allclose(head_alone, logits(model, ids), atol=1e-2)
            feats, head = features(model, ids)
            assert torch.equal(head(feats), logits(model, ids))


def test_left_padding_with_an_attention_mask_scores_the_same_where_asked() -> None:
    model = llama(True)().eval()
    ids, where, _, sampling = batch_tensors()
    ids[0, :7] = 0
    attention = torch.ones_like(ids)
    attention[0, :7] = 0
    with torch.no_grad():
        full = token_logprobs(model, ids, 1.0, attention, sampling=sampling)
        part = token_logprobs(model, ids, 1.0, attention, sampling=sampling, where=where)
    assert (part[where] - full[where]).abs().max() <= TOL and (part[~where] == 0).all()


def test_where_must_have_the_scored_shape() -> None:
    ids = batch_tensors()[0]
    with pytest.raises(ValueError, match="where"):
        token_logprobs(tiny(), ids, where=torch.ones(3, 40, dtype=torch.bool))


# ------------------------------------------------------------------ the trainer's step


def step_batch(model: nn.Module) -> BatchSamples:
    """Four multi-turn samples (two replies each, the loss on ~35 % of the positions), rollout logprobs a
    little off the model's (ratios not 1), half the tokens sampled by ``v1``, sampling parameters mixed."""
    gen = torch.Generator().manual_seed(2)
    samples = []
    recorded = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9),
                SamplingParams(temperature=1.2, top_k=20), SamplingParams()]
    for i, n in enumerate([40, 33, 48, 25]):
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        mask = [0] * n
        for start, end in ((n // 4, n // 4 + n // 8), (n - n // 4, n)):
            mask[start:end] = [1] * (end - start)
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0]
        noise = 0.3 * torch.randn(n - 1, generator=gen)
        rollout = [0.0, *(lp + noise).tolist()]
        versions = tuple(("v1" if t % 2 else "v0") if m else None for t, m in enumerate(mask))
        sampling = tuple(recorded[i] if m else None for m in mask)
        samples.append(Sample(ids, mask, rollout, i, 0, f"s{i}", versions, sampling))
    return BatchSamples(samples=samples, rewards=[1.0, 0.0, 0.5, 0.0], trajectory_group=[0, 0, 1, 1], groups=2)


@pytest.mark.parametrize(
    ("name", "correction", "micro"),
    [("tiny", "none", 0), ("tiny", "m2po", 2), ("tiny", "geo_mask", 0), ("llama-tied", "none", 2),
     ("llama-untied", "tis", 0), ("gemma2-softcap", "none", 0)],
)
def test_step_on_trained_tokens_only_equals_the_full_paths_step(name: str, correction: str, micro: int) -> None:
    make, split = FAMILIES[name]
    model = make()
    batch = step_batch(model)
    hyper = LossSettings(micro_batch_size=micro, offpolicy_correction=correction)
    trainers = [PolicyTrainer(copy.deepcopy(model), hyper, torch.device("cpu")) for _ in range(2)]
    trainers[1].score_every_position = True
    stepped = [record_stepped_gradients(trainer) for trainer in trainers]
    stats = []
    for trainer in trainers:
        stats.append(trainer.step(batch, version="v1"))
    part, full = stats
    assert part.updated and full.updated
    assert part.trained_tokens == full.trained_tokens == batch.trained_tokens
    assert part.same_version_tokens == full.same_version_tokens > 0
    for key in ("loss", "train_rollout_logprob_abs_diff", "ratio_mean", "grad_norm", "clip_fraction",
                "truncated_fraction", "offpolicy_masked_fraction", "offpolicy_clipped_fraction"):
        assert getattr(part, key) == pytest.approx(getattr(full, key), abs=TOL), key
    assert part.train_rollout_logprob_abs_diff_same_version == pytest.approx(
        full.train_rollout_logprob_abs_diff_same_version, abs=TOL)
    assert len(stepped[0]) == len(stepped[1]) == 1
    for a, b in zip(stepped[0][0], stepped[1][0], strict=True):
        assert (a - b).abs().max() <= TOL

    fresh = PolicyTrainer(copy.deepcopy(model), hyper, torch.device("cpu"))
    rows = head_rows(fresh.model, lambda: fresh.step(batch, version="v1"))
    positions = sum(len(s.token_ids) for s in batch.samples)
    if split:
        assert sum(rows) == batch.trained_tokens * (2 if correction == "m2po" and micro else 1)
    else:
        assert sum(rows) >= positions
