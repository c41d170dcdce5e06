"""The decode loop state machine, driven step by step without HTTP."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from services.engine import batcher as batcher_module
from services.engine.batcher import AdmissionError, Batcher, DuplicateRidError, Weights
from services.engine.sampling import SamplingParams, completes_stop, sample_next
from shared.checkpoint import digest
from shared.policy import PolicyConfig, TinyPolicy, init_policy
from shared.tokenizer import TOKENIZER

CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size, context=16, width=16, layers=1, heads=2)
PROMPT = TOKENIZER.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True)
NO_STOP = SamplingParams(max_new_tokens=8, ignore_eos=True)


def weights(seed: int = 0, version: str = "v0", cfg: PolicyConfig = CFG) -> Weights:
    model = init_policy(cfg, seed).eval()
    return Weights(model=model, version=version, digest=digest(model.state_dict()), step=0, model_path=None)


class Held(TinyPolicy):
    """Says it ``entered`` each forward, then waits for ``gate``: a step held mid-way."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.gate, self.entered = threading.Event(), threading.Event()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(10)
        return super().forward(ids)


class Forced(TinyPolicy):
    """Always puts (almost) all mass on one token; records the batch sizes it sees."""

    def __init__(self, cfg: PolicyConfig, token: int) -> None:
        super().__init__(cfg)
        self.token = token
        self.batch_sizes: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(ids.shape[0])
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.config.vocab_size)
        logits[..., self.token] = 50.0
        return logits


def forced(token: int, version: str = "v0") -> tuple[Weights, Forced]:
    model = Forced(CFG, token)
    return Weights(model=model, version=version, digest="forced", step=0, model_path=None), model


def test_concurrent_requests_share_steps() -> None:
    w, model = forced(TOKENIZER.token_id("7"))
    b = Batcher(w, end_id=TOKENIZER.end_id)
    reqs = [b.admit(f"r{i}", PROMPT[: i + 1], SamplingParams(max_new_tokens=3)) for i in range(3)]
    reports = [b.step() for _ in range(3)]
    assert model.batch_sizes == [3, 3, 3]
    assert [r.batch_size for r in reports] == [3, 3, 3]
    assert reports[-1].finished == reqs
    assert all(r.output_ids == [TOKENIZER.token_id("7")] * 3 and r.finish_type == "length" for r in reqs)
    assert not b.has_work()


def test_new_request_joins_next_step() -> None:
    w, model = forced(TOKENIZER.token_id("7"))
    b = Batcher(w, end_id=TOKENIZER.end_id)
    first = b.admit("a", PROMPT, NO_STOP)
    b.step()
    second = b.admit("b", PROMPT, NO_STOP)
    b.step()
    assert model.batch_sizes == [1, 2]
    assert (len(first.output_ids), len(second.output_ids)) == (2, 1)


def test_max_batch_size_is_respected_fifo() -> None:
    w, model = forced(TOKENIZER.token_id("7"))
    b = Batcher(w, end_id=TOKENIZER.end_id, max_batch_size=2)
    reqs = [b.admit(f"r{i}", PROMPT, SamplingParams(max_new_tokens=1)) for i in range(3)]
    assert b.step().finished == reqs[:2]
    assert b.step().finished == reqs[2:]
    assert model.batch_sizes == [2, 1]


def test_stop_token_ends_with_stop_and_is_included() -> None:
    w, _ = forced(TOKENIZER.end_id)
    b = Batcher(w, end_id=TOKENIZER.end_id)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=5))
    report = b.step()
    assert report.finished == [req]
    assert (req.finish_type, req.output_ids, req.matched_stop) == ("stop", [TOKENIZER.end_id], TOKENIZER.end_id)
    assert req.weight_version == "v0"


def test_extra_stop_ids_and_ignore_eos() -> None:
    seven = TOKENIZER.token_id("7")
    b = Batcher(forced(seven)[0], end_id=TOKENIZER.end_id)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=5, stop_token_ids=(seven,)))
    b.step()
    assert (req.finish_type, req.matched_stop) == ("stop", seven)
    b2 = Batcher(forced(TOKENIZER.end_id)[0], end_id=TOKENIZER.end_id)
    req2 = b2.admit("r", PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True))
    b2.step()
    b2.step()
    assert (req2.finish_type, req2.output_ids) == ("length", [TOKENIZER.end_id] * 2)


def test_budget_ends_with_length() -> None:
    b = Batcher(weights(), end_id=TOKENIZER.end_id, seed=1)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for _ in range(4):
        b.step()
    assert (req.finish_type, len(req.output_ids), len(req.logprobs)) == ("length", 4, 4)
    assert all(lp <= 0 for lp in req.logprobs)


def test_context_full_ends_with_length() -> None:
    b = Batcher(weights(), end_id=TOKENIZER.end_id)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=100, ignore_eos=True))
    while b.has_work():
        b.step()
    assert req.finish_type == "length"
    assert req.length == CFG.context


def test_abort_returns_partial_tokens() -> None:
    b = Batcher(weights(), end_id=TOKENIZER.end_id)
    req = b.admit("r-1", PROMPT, NO_STOP)
    other = b.admit("r-10", PROMPT, NO_STOP)
    b.step()
    b.step()
    assert b.abort("r-1") == [req]
    assert (req.finish_type, len(req.output_ids), req.weight_version) == ("abort", 2, "v0")
    assert b.active_rids() == ["r-10"]  # exact match, not prefix
    b.step()
    assert len(req.output_ids) == 2 and len(other.output_ids) == 3
    assert b.abort(abort_all=True) == [other]
    assert not b.has_work()


def test_late_abort_after_natural_finish_changes_nothing() -> None:
    b = Batcher(forced(TOKENIZER.end_id)[0], end_id=TOKENIZER.end_id)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=5))
    b.step()
    assert req.finish_type == "stop"
    assert b.abort("r") == []
    assert b.abort(abort_all=True) == []
    assert not b.abort_request(req)
    assert (req.finish_type, req.output_ids) == ("stop", [TOKENIZER.end_id])
    assert b.finished("r") and not b.finished("never-seen")  # a late abort can tell the two apart


def test_finished_rids_are_remembered_boundedly_and_forgotten_when_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batcher_module, "FINISHED_RIDS", 2)
    b = Batcher(weights(), end_id=TOKENIZER.end_id)
    for rid in ("a", "b", "c"):
        b.admit(rid, PROMPT, NO_STOP)
        assert not b.finished(rid)  # active: not finished
        b.abort(rid)
    assert [b.finished(rid) for rid in ("a", "b", "c")] == [False, True, True]
    b.admit("b", PROMPT, NO_STOP)  # the rid runs again: it is not finished any more
    assert not b.finished("b")


def test_abort_during_step_discards_that_steps_token() -> None:
    model = Held().eval()
    b = Batcher(Weights(model, "v0", "d", 0, None), end_id=TOKENIZER.end_id)
    req = b.admit("r", PROMPT, NO_STOP)
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(b.step()))
    t.start()
    assert model.entered.wait(10)
    assert b.abort("r") == [req]
    model.gate.set()
    t.join(10)
    assert not t.is_alive()
    assert (req.finish_type, req.output_ids, req.logprobs) == ("abort", [], [])


def test_weight_swap_mid_generation_stamps_new_version() -> None:
    b = Batcher(weights(0, "v0"), end_id=TOKENIZER.end_id)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    b.step()
    b.step()
    old = b.swap_weights(weights(1, "v1"))
    assert old.version == "v0" and b.weights.version == "v1"
    b.step()
    report = b.step()
    assert report.version == "v1" and report.finished == [req]
    assert req.versions == ["v0", "v0", "v1", "v1"]
    assert req.weight_version == "v1"


def test_swap_during_step_applies_from_next_step() -> None:
    model = Held().eval()
    b = Batcher(Weights(model, "v0", "d", 0, None), end_id=TOKENIZER.end_id)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True))
    t = threading.Thread(target=b.step)
    t.start()
    assert model.entered.wait(10)
    b.swap_weights(weights(1, "v1"))
    model.gate.set()
    t.join(10)
    b.step()
    assert req.versions == ["v0", "v1"]
    assert req.weight_version == "v1"


def test_admission_rules() -> None:
    b = Batcher(weights(), end_id=TOKENIZER.end_id)
    b.admit("dup", PROMPT, NO_STOP)
    with pytest.raises(DuplicateRidError, match="'dup'"):
        b.admit("dup", PROMPT, NO_STOP)
    with pytest.raises(AdmissionError, match="longer than the context window of 16"):
        b.admit("long", [1] * 17, NO_STOP)
    with pytest.raises(AdmissionError, match="empty"):
        b.admit("empty", [], NO_STOP)
    with pytest.raises(AdmissionError, match="outside the vocabulary"):
        b.admit("bad", [TOKENIZER.vocab_size], NO_STOP)
    full = b.admit("full", [1] * 16, NO_STOP)
    zero = b.admit("zero", PROMPT, SamplingParams(max_new_tokens=0))
    assert (full.finish_type, zero.finish_type) == ("length", "length")
    assert full.output_ids == zero.output_ids == []
    assert b.active_rids() == ["dup"]
    # a finished rid may be reused
    b.abort("dup")
    assert b.admit("dup", PROMPT, NO_STOP).rid == "dup"


def test_batched_equals_alone_greedy() -> None:
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    alone = Batcher(weights(3), end_id=TOKENIZER.end_id)
    a = alone.admit("a", PROMPT, greedy)
    while alone.has_work():
        alone.step()
    batched = Batcher(weights(3), end_id=TOKENIZER.end_id)
    b = batched.admit("a", PROMPT, greedy)
    batched.admit("long", PROMPT * 2, greedy)
    batched.admit("short", PROMPT[:1], greedy)
    while batched.has_work():
        batched.step()
    assert a.output_ids == b.output_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_sample_next_filters_and_logprobs() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 4)
    temp = torch.tensor([1.0, 0.5, 1.0, 0.0])
    top_k = torch.tensor([1, -1, -1, -1])
    top_p = torch.tensor([1.0, 1.0, 1e-6, 1.0])
    for _ in range(20):
        tokens, lps = sample_next(logits, temperature=temp, top_k=top_k, top_p=top_p, generator=gen)
        assert tokens[0] == 0 and tokens[2] == 0 and tokens[3] == 0  # top-k 1, tiny top-p, greedy
        # the probability each token had where it was drawn: 1 for a one-token set and for greedy
        tempered = torch.log_softmax(logits[1] / 0.5, -1)[tokens[1]]
        assert torch.allclose(lps, torch.stack([torch.tensor(0.0), tempered, torch.tensor(0.0), torch.tensor(0.0)]))


def test_sample_next_filtered_logprob_is_the_renormalised_probability() -> None:
    """Draws under top-k / top-p follow the renormalised kept set, and each reported logprob is the
    log of the frequency it is drawn with (what an importance ratio needs), not the unfiltered one."""
    gen = torch.Generator().manual_seed(3)
    n = 20_000
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).expand(n, 4).contiguous()
    for top_k, top_p in ((3, 1.0), (-1, 0.8), (3, 0.9)):
        tokens, lps = sample_next(logits, temperature=torch.full((n,), 0.9), top_k=torch.full((n,), top_k),
                                  top_p=torch.full((n,), top_p), generator=gen)
        freq = torch.bincount(tokens, minlength=4).float() / n
        reported = torch.full((4,), float("-inf"))
        reported[tokens] = lps
        assert torch.allclose(freq, reported.exp(), atol=0.015), (top_k, top_p)
        assert freq[3] == 0  # every setting here drops the least likely token


def test_sample_next_top_k_excludes_tail() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.zeros(1000, 5)
    tokens, _ = sample_next(
        logits, temperature=torch.ones(1000), top_k=torch.full((1000,), 2), top_p=torch.ones(1000), generator=gen
    )
    # all logits tie: sort keeps two of them; only those two may ever be drawn
    assert len(set(tokens.tolist())) == 2


@pytest.mark.parametrize("mixed_greedy", [False, True])
def test_sample_next_unfiltered_draws_follow_the_tempered_softmax(mixed_greedy: bool) -> None:
    """The path without top-k/top-p (no sort) samples softmax(logits / T); greedy rows stay argmax."""
    gen = torch.Generator().manual_seed(1)
    n = 20_000
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]]).expand(n, 4).contiguous()
    temp = torch.full((n,), 0.7)
    if mixed_greedy:
        temp[::2] = 0.0
    tokens, lps = sample_next(logits, temperature=temp, top_k=torch.full((n,), -1), top_p=torch.ones(n),
                              generator=gen)
    sampled = tokens[1::2] if mixed_greedy else tokens
    freq = torch.bincount(sampled, minlength=4).float() / len(sampled)
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.015)
    if mixed_greedy:
        assert bool((tokens[::2] == 0).all())
    expected = torch.log_softmax(logits / torch.where(temp > 0, temp, 1.0)[:, None], -1)
    expected = torch.where(temp[:, None] > 0, expected, torch.zeros_like(expected))  # greedy: probability 1
    assert torch.allclose(lps, expected.gather(-1, tokens[:, None]).squeeze(-1))


def test_sample_next_all_greedy_is_argmax_without_drawing() -> None:
    gen = torch.Generator().manual_seed(2)
    state = gen.get_state()
    logits = torch.randn(8, 50)
    tokens, _ = sample_next(logits, temperature=torch.zeros(8), top_k=torch.full((8,), -1), top_p=torch.ones(8),
                            generator=gen)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(gen.get_state(), state)  # no random draw spent on greedy rows


def _chars(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


@pytest.mark.parametrize(
    ("text", "new", "stops", "found"),
    [
        ("abc\n\n", 1, ["\n\n"], "\n\n"),
        ("abc\n\nd", 1, ["\n\n"], None),  # completed by an earlier token: not this one's
        ("Obs", 1, ["Observation:", "bs"], "bs"),
        ("x: END", 2, ["END"], "END"),
        ("prompt END then", 1, ["END"], None),  # only in the older text (a prompt)
        ("EN" + "D", 1, ["END"], "END"),  # across the input/output boundary: the preempt case
        ("abc", 1, [], None),
    ],
)
def test_completes_stop(text: str, new: int, stops: list[str], found: str | None) -> None:
    assert completes_stop([ord(c) for c in text], new, stops, _chars) == found


def test_a_stop_string_ends_the_request_with_the_token_that_completes_it() -> None:
    seven = TOKENIZER.token_id("7")
    b = Batcher(forced(seven)[0], end_id=TOKENIZER.end_id, decode=TOKENIZER.decode)
    req = b.admit("r", PROMPT, SamplingParams(max_new_tokens=9, stop=("7 7 7",)))
    for _ in range(3):
        b.step()
    assert (req.finish_type, req.matched_stop, req.output_ids) == ("stop", "7 7 7", [seven] * 3)
    with pytest.raises(AdmissionError, match="stop strings"):
        Batcher(forced(seven)[0], end_id=TOKENIZER.end_id).admit("s", PROMPT, SamplingParams(stop=("x",)))
