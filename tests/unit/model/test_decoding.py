"""Cached decoding equals a full recompute, for the tiny policy and a small Llama."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from shared.model.decoding import MAX_PADDING, Decoder, full_logits, prefill_groups
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
MODELS = {name: make() for name, make in FAMILIES.items()}
"""One instance of each, shared by the property test's examples (a model is read-only here)."""


def reference(model: nn.Module, prefix: list[int]) -> torch.Tensor:
    return full_logits(model, torch.tensor([prefix]))[0, -1].float()


@pytest.mark.parametrize("max_padding", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_equals_full_recompute(family: str, max_padding: float) -> None:
    """Rows of different lengths, some joining mid-way while others decode, one aborted, one resumed
    with a longer prefix; prefills one length per forward (0.0), bucketed, or all in one (1.0)."""
    model = FAMILIES[family]()
    gen = torch.Generator().manual_seed(1)
    vocab = int(full_logits(model, torch.tensor([[1]])).shape[-1])

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    decoder = Decoder(model, max_padding=max_padding)
    prefixes: dict[str, list[int]] = {"a": rand(3), "b": rand(11), "c": rand(1), "c2": rand(1), "d": rand(6)}
    for step in range(12):
        if step == 4:  # join mid-way, in the same step as the others decode
            prefixes["late"] = rand(7)
            prefixes["late2"] = rand(7)  # same length: prefilled in the same forward
            prefixes["late3"] = rand(2)  # other lengths: left-padded into one forward unless max_padding forbids
            prefixes["late4"] = rand(20)
        if step == 6:
            del prefixes["b"]  # aborted: its row is freed
            del prefixes["late4"]  # the longest row leaves: the padding it needed is trimmed
            prefixes["late5"] = rand(4)  # joins in the step rows are freed
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
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=st.lists(st.lists(st.integers(0, 24), max_size=5), min_size=1, max_size=5),
       leave=st.lists(st.booleans(), max_size=30), max_padding=st.sampled_from([MAX_PADDING, 0.3, 0.5, 1.0]))
def test_mixed_length_schedules_equal_full_recompute(family: str, schedule: list[list[int]], leave: list[bool],
                                                     max_padding: float) -> None:
    """Any schedule of leaves and joins of any lengths (0: a resumed generation, a new key whose prefix
    extends a running row's) decodes as a full forward over each prefix."""
    model = MODELS[family]
    gen = torch.Generator().manual_seed(len(schedule))
    decoder = Decoder(model, max_padding=max_padding)
    prefixes: dict[int, list[int]] = {}
    leaving = iter(leave)
    for step, joins in enumerate(schedule):
        for key in [k for k in prefixes if next(leaving, False)]:
            del prefixes[key]
        for j, n in enumerate(joins):
            key = 100 * step + j
            old = next(iter(prefixes.values()), None) if n == 0 else None
            fresh = torch.randint(0, 50, (max(n, 1),), generator=gen).tolist()
            prefixes[key] = [*old, 1, 2] if old is not None else fresh
        if not prefixes:
            continue
        batch = list(prefixes.items())
        got = decoder.last_logits(batch)
        for i, (key, prefix) in enumerate(batch):
            diff = (got[i] - reference(model, prefix)).abs().max().item()
            assert diff < TOL, f"{family} step {step} row {key} (length {len(prefix)}): max |diff| {diff}"
        assert decoder.rows() == {k: len(p) for k, p in prefixes.items()}
        for (_, prefix), tok in zip(batch, got.argmax(-1).tolist(), strict=True):
            prefix.append(int(tok))


@given(lengths=st.lists(st.integers(1, 300), max_size=12), max_padding=st.floats(0.0, 1.0))
def test_prefill_groups_bound_padding(lengths: list[int], max_padding: float) -> None:
    groups = prefill_groups(lengths, max_padding)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        width = lengths[group[0]]
        assert all(lengths[i] <= width for i in group)
        assert sum(width - lengths[i] for i in group) <= max_padding * width * len(group) + 1e-9


def test_prefill_groups_extremes() -> None:
    lengths = [5, 9, 5, 200, 9, 1]
    assert prefill_groups(lengths, 0.0) == [[3], [1, 4], [0, 2], [5]], "equal lengths only, longest first"
    assert prefill_groups(lengths, 1.0) == [[3, 1, 4, 0, 2, 5]], "everything in one forward"
    assert prefill_groups(lengths, 0.25) == [[3], [1, 4, 0, 2], [5]], "9 padded to 200 is 48 % padding"
    assert prefill_groups(lengths, 0.5) == [[3, 1], [4, 0, 2, 5]], "a share of the group: up to 2x its positions"


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
