"""Cached decoding equals a full recompute, for the tiny policy and a small Llama."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from shared.model.decoding import Decoder, full_logits
from shared.policy import PolicyConfig, TinyPolicy, init_policy

TOL = 1e-4


def tiny() -> nn.Module:
    return init_policy(PolicyConfig(vocab_size=50, context=64, width=32, layers=2, heads=4), 0).eval()


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


FAMILIES: dict[str, Callable[[], nn.Module]] = {"tiny": tiny, "llama": llama}


def reference(model: nn.Module, prefix: list[int]) -> torch.Tensor:
    return full_logits(model, torch.tensor([prefix]))[0, -1].float()


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_equals_full_recompute(family: str) -> None:
    """Rows of different lengths, one joining mid-way, one aborted, one resumed with a longer prefix."""
    model = FAMILIES[family]()
    gen = torch.Generator().manual_seed(1)
    vocab = int(full_logits(model, torch.tensor([[1]])).shape[-1])

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    decoder = Decoder(model)
    prefixes: dict[str, list[int]] = {"a": rand(3), "b": rand(11), "c": rand(1), "c2": rand(1)}
    for step in range(12):
        if step == 4:
            prefixes["late"] = rand(7)  # joins mid-way
            prefixes["late2"] = rand(7)  # same length: prefilled in the same forward
        if step == 6:
            del prefixes["b"]  # aborted: its row is freed
        if step == 9:
            prefixes["b2"] = prefixes["a"] + rand(2)  # a resumed generation: a new key, a longer prefix
        batch = list(prefixes.items())
        got = decoder.last_logits(batch)
        assert got.shape == (len(batch), vocab)
        for i, (key, prefix) in enumerate(batch):
            diff = (got[i] - reference(model, prefix)).abs().max().item()
            assert diff < TOL, f"{family} step {step} row {key}: max |diff| {diff}"
        assert set(decoder.rows()) == set(prefixes)
        assert decoder.rows() == {k: len(p) for k, p in prefixes.items()}
        next_tokens = got.argmax(-1).tolist()
        for (_, prefix), tok in zip(batch, next_tokens, strict=True):
            prefix.append(int(tok))
    # the padded cache holds rows x longest row and shrinks when the longest leaves
    assert decoder.tokens == len(prefixes) * max(len(p) - 1 for p in prefixes.values())
    decoder.last_logits([])
    assert decoder.tokens == 0 and decoder.rows() == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_not_one_longer_is_prefilled_again(family: str) -> None:
    model = FAMILIES[family]()
    decoder = Decoder(model)
    decoder.last_logits([("r", [1, 2, 3])])
    got = decoder.last_logits([("r", [1, 2, 3, 4, 5])])  # skipped a token: re-prefill, not a wrong decode
    assert (got[0] - reference(model, [1, 2, 3, 4, 5])).abs().max().item() < TOL
    assert decoder.rows() == {"r": 5}


def test_tiny_forward_cached_without_past_is_forward() -> None:
    model = tiny()
    assert isinstance(model, TinyPolicy)
    ids = torch.randint(0, 50, (2, 9))
    with torch.inference_mode():
        logits, kv = model.forward_cached(ids, torch.arange(9).expand(2, 9))
        assert torch.equal(logits, model(ids))
    assert len(kv) == 2 and kv[0][0].shape == (2, 4, 9, 8)
