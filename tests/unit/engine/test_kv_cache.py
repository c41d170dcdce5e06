"""The batcher's KV cache: same tokens as a full recompute, a bounded token budget, rows freed."""

from __future__ import annotations

import pytest
import torch

from services.engine.batcher import AdmissionError, Batcher, Weights
from services.engine.sampling import SamplingParams
from shared.policy import PolicyConfig, TinyPolicy, init_policy
from shared.tokenizer import TOKENIZER

CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size, context=32, width=16, layers=2, heads=2)
PROMPT = TOKENIZER.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True)


class Recompute(TinyPolicy):
    """The same policy served without a cache (a forward override opts out of it)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)


def weights(seed: int, version: str, cached: bool = True) -> Weights:
    model = init_policy(CFG, seed) if cached else Recompute(CFG)
    if not cached:
        model.load_state_dict(init_policy(CFG, seed).state_dict())
    return Weights(model.eval(), version, f"d{seed}", 0, None)


def run(cached: bool) -> list[tuple[list[int], list[float], list[str]]]:
    """Greedy and sampled requests of different lengths, one joining late, one aborted, a weight swap."""
    b = Batcher(weights(0, "v0", cached), end_id=TOKENIZER.end_id, seed=7)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [b.admit("a", PROMPT, sampled), b.admit("b", PROMPT[:2], greedy)]
    for i in range(14):
        if i == 2:
            reqs.append(b.admit("late", PROMPT * 2, sampled))
        if i == 4:
            b.abort("b")
            reqs.append(b.admit("b", PROMPT[:2] + reqs[1].output_ids, greedy))  # resumed: longer prefix
        if i == 6:
            b.swap_weights(weights(1, "v1", cached))
        b.step()
    return [(r.output_ids, r.logprobs, r.versions) for r in reqs]


def test_cached_engine_samples_what_a_full_recompute_samples() -> None:
    cached, recomputed = run(True), run(False)
    for (ids_c, lps_c, vs_c), (ids_r, lps_r, vs_r) in zip(cached, recomputed, strict=True):
        assert ids_c == ids_r and vs_c == vs_r
        assert lps_c == pytest.approx(lps_r, abs=1e-4)
    assert cached[0][2][5:8] == ["v0", "v1", "v1"]  # the swap took effect mid-request


def test_budget_bounds_the_cache_and_queues_the_rest() -> None:
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    need = len(PROMPT) + 4
    b = Batcher(weights(0, "v0"), end_id=TOKENIZER.end_id, kv_budget_tokens=2 * need)
    reqs = [b.admit(f"r{i}", PROMPT, params) for i in range(3)]
    sizes = []
    while b.has_work():
        sizes.append(b.step().batch_size)
        assert b.kv_tokens() <= 2 * need
    assert sizes == [2, 2, 2, 2, 1, 1, 1, 1]  # the third waited for a slot, never an overflow
    assert all(len(r.output_ids) == 4 for r in reqs)
    assert b.active_rids() == []
    with pytest.raises(AdmissionError, match="KV cache"):
        b.admit("huge", PROMPT, SamplingParams(max_new_tokens=2 * need))


def test_waiting_request_is_active_and_abortable() -> None:
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    b = Batcher(weights(0, "v0"), end_id=TOKENIZER.end_id, kv_budget_tokens=len(PROMPT) + 4)
    first = b.admit("first", PROMPT, params)
    queued = b.admit("queued", PROMPT, params)
    assert b.step().batch_size == 1
    assert b.active_rids() == ["first", "queued"] and queued.output_ids == []
    assert b.abort("queued") == [queued]
    while b.has_work():
        b.step()
    assert (first.finish_type, queued.finish_type) == ("length", "abort")


def test_finished_and_aborted_rows_are_freed() -> None:
    b = Batcher(weights(0, "v0"), end_id=TOKENIZER.end_id)
    b.admit("a", PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
    b.admit("b", PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
    b.step()
    assert b.kv_tokens() == 2 * len(PROMPT)
    b.abort("a")
    b.step()
    assert b.kv_tokens() == len(PROMPT) + 1
    b.abort("b")
    b.step()  # a step with nothing to decode frees the rest
    assert b.kv_tokens() == 0
