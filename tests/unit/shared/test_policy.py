"""The tiny policy: shapes, determinism under a seed, causality, logprob sanity."""

from __future__ import annotations

import pytest
import torch

from shared.policy import PolicyConfig, TinyPolicy, init_policy, token_logprobs
from shared.tokenizer import TOKENIZER

CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size)


def test_defaults_and_size() -> None:
    model = init_policy(CFG, seed=0)
    assert (CFG.context, CFG.width, CFG.layers, CFG.heads, CFG.dropout) == (64, 64, 2, 4, 0.0)
    assert 80_000 <= model.num_parameters() <= 130_000


def test_forward_shape() -> None:
    model = init_policy(CFG, seed=0)
    ids = torch.randint(0, CFG.vocab_size, (3, 10))
    assert model(ids).shape == (3, 10, CFG.vocab_size)


def test_deterministic_under_seed_and_leaves_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = init_policy(CFG, 7), init_policy(CFG, 7), init_policy(CFG, 8)
    assert torch.equal(torch.random.get_rng_state(), before)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb
        assert torch.equal(va, vb)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_causal_and_right_padding_invariant() -> None:
    model = init_policy(CFG, seed=1).eval()
    ids = torch.randint(0, CFG.vocab_size, (1, 12))
    padded = torch.cat([ids, torch.zeros((1, 5), dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert torch.allclose(model(ids), model(padded)[:, :12], atol=1e-5)


def test_context_limit() -> None:
    model = init_policy(PolicyConfig(vocab_size=10, context=8, width=16, heads=2), seed=0)
    with pytest.raises(ValueError, match="context window 8"):
        model(torch.zeros((1, 9), dtype=torch.long))


def test_token_logprobs_match_distribution() -> None:
    model = init_policy(CFG, seed=2).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    with torch.no_grad():
        lp = token_logprobs(model, ids)
        assert lp.shape == (2, 8)
        assert bool((lp <= 0).all())
        full = torch.log_softmax(model(ids)[:, :-1], dim=-1)
        assert torch.allclose(full.exp().sum(-1), torch.ones(2, 8), atol=1e-5)
        assert torch.allclose(lp, full.gather(-1, ids[:, 1:, None]).squeeze(-1), atol=1e-6)
        # a higher temperature flattens the distribution towards uniform
        hot = token_logprobs(model, ids, temperature=100.0)
        uniform = -torch.log(torch.tensor(float(CFG.vocab_size)))
        assert torch.allclose(hot, uniform.expand_as(hot), atol=0.05)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, temperature=0.0)


def test_gradients_flow() -> None:
    model = init_policy(CFG, seed=3)
    ids = torch.randint(0, CFG.vocab_size, (2, 6))
    token_logprobs(model, ids).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="divisible"):
        PolicyConfig(vocab_size=10, width=30, heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        PolicyConfig(vocab_size=0)


def test_config_round_trips_through_a_dict() -> None:
    """A checkpoint stores ``to_dict()``; ``from_dict`` must rebuild the same architecture."""
    restored = PolicyConfig.from_dict(CFG.to_dict())
    assert restored == CFG
    shapes = {name: tuple(t.shape) for name, t in TinyPolicy(CFG).state_dict().items()}
    assert {name: tuple(t.shape) for name, t in TinyPolicy(restored).state_dict().items()} == shapes
