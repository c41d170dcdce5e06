"""The model layer: the tiny family unchanged, the HF family with the SmolLM2 tokenizer on a tiny Llama."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from shared import checkpoint, policy
from shared.model import CheckpointError, ModelError, load_family
from shared.model.compute import (
    context_window_of,
    set_gradient_checkpointing,
    token_logprobs,
    token_logprobs_and_entropy,
)
from shared.model.gguf import default_target, is_converted, source_key
from shared.model.hf import SIDECAR, HFFamily
from shared.model.sampling import SamplingTensors
from shared.policy import PolicyConfig, init_policy
from shared.tokenizer import TOKENIZER

CPU = torch.device("cpu")


# ------------------------------------------------------------------ tiny: exactly as before


def test_tiny_family_is_todays_policy_tokenizer_and_checkpoint(tmp_path: Path) -> None:
    family = load_family("tiny")
    assert (family.name, family.kind, family.context_window, family.checkpoint_suffix) == ("tiny", "tiny", 64, ".pt")
    tok = family.tokenizer
    assert (tok.vocab_size, tok.pad_id, tok.stop_ids) == (TOKENIZER.vocab_size, TOKENIZER.pad_id, {TOKENIZER.end_id})
    messages = [{"role": "system", "content": "guess the number"}, {"role": "user", "content": "higher 7"}]
    assert tok.encode_chat(messages, add_generation_prompt=True) == TOKENIZER.apply_chat_template(messages, True)
    assert tok.decode([2, 6, 7, 5]) == TOKENIZER.decode([2, 6, 7, 5])

    model = family.new_model(3, CPU)
    reference = init_policy(PolicyConfig(vocab_size=TOKENIZER.vocab_size), 3)
    assert family.digest(model) == checkpoint.digest(reference.state_dict())
    ids = torch.tensor([[2, 6, 7, 8, 5, 4, 9]])
    assert torch.equal(token_logprobs(model, ids, 0.7), policy.token_logprobs(reference, ids, 0.7))

    digest = family.save(model, tmp_path / "v3.pt", version="v3", step=3)
    assert checkpoint.load(tmp_path / "v3.pt").digest == digest  # today's file format
    loaded = family.load(tmp_path / "v3.pt", CPU)
    assert (loaded.version, loaded.step, loaded.digest) == ("v3", 3, digest)
    assert context_window_of(family, loaded.model) == 64
    assert not set_gradient_checkpointing(model, True)


def test_tiny_family_takes_a_shape_and_rejects_a_foreign_model(tmp_path: Path) -> None:
    family = load_family("tiny", tiny_config=PolicyConfig(vocab_size=TOKENIZER.vocab_size, context=32, width=32))
    assert family.context_window == 32
    assert sum(p.numel() for p in family.new_model(0, CPU).parameters()) < 60_000
    with pytest.raises(TypeError):
        family.save(torch.nn.Linear(2, 2), tmp_path / "x.pt", version="v0", step=0)


def test_entropy_is_that_of_each_tokens_sampling_distribution() -> None:
    """Same logprobs as token_logprobs; the entropy of the softmax (temperature, top-k filter applied) at
    each scored position, 0 elsewhere; the top-k's filtered tokens add nothing (no NaN from 0 * -inf)."""
    family = load_family("tiny", tiny_config=PolicyConfig(vocab_size=TOKENIZER.vocab_size, context=16, width=16,
                                                          layers=1, heads=2))
    model = family.new_model(0, CPU)
    ids = torch.tensor([[2, 6, 7, 8, 5], [3, 9, 4, 4, 1]])
    where = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    temp = torch.full((2, 4), 0.8)
    top_k = torch.full((2, 4), 5, dtype=torch.long)
    sampling = SamplingTensors(temp, top_k, torch.ones(2, 4))
    logp, entropy = token_logprobs_and_entropy(model, ids, sampling=sampling, where=where)
    assert torch.equal(logp, token_logprobs(model, ids, sampling=sampling, where=where))
    with torch.no_grad():
        full = torch.log_softmax(torch.topk(model(ids)[:, :-1] / 0.8, 5, dim=-1).values, dim=-1)
    expected = -(full.exp() * full).sum(-1)
    assert torch.allclose(entropy[where], expected[where], atol=1e-5)
    assert torch.equal(entropy[~where], torch.zeros(int((~where).sum())))
    entropy.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_unknown_specs_are_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="expected 'tiny'"):
        load_family(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match=r"no config\.json"):
        load_family(str(tmp_path))


# ------------------------------------------------------------------ HF tokenizer (SmolLM2's)


@pytest.fixture(scope="module")
def family(tiny_llama_dir: Path) -> HFFamily:
    found = load_family(str(tiny_llama_dir))
    assert isinstance(found, HFFamily)
    return found


def test_hf_family_identity(family: HFFamily, tiny_llama_dir: Path) -> None:
    tok = family.tokenizer
    assert (family.kind, family.name, family.checkpoint_suffix) == ("hf", tiny_llama_dir.name, "")
    assert family.context_window == 512  # max_position_embeddings
    assert tok.vocab_size == 49152
    assert tok.pad_id == 2 and 2 in tok.stop_ids  # <|im_end|>: EOS, end of turn and pad
    assert HFFamily(tiny_llama_dir, context_cap=128).context_window == 128


def _conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 17 + 25?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And 6 * 7?"},
        {"role": "assistant", "content": "Also 42."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_multi_turn_renders_every_turn_and_stays_prefix_stable(family: HFFamily) -> None:
    tok = family.tokenizer
    chat = _conversation()
    full = tok.encode_chat(chat, add_generation_prompt=True)
    text = tok.decode(full)
    assert text == (
        "system\nAnswer with a number.\nuser\nWhat is 17 + 25?\nassistant\n42\nuser\nAnd 6 * 7?\n"
        "assistant\nAlso 42.\nuser\nThanks!\nassistant\n"
    )
    for k in (2, 4):  # an agent's turn: prompt with generation prompt, then the next turn appended
        prompt = tok.encode_chat(chat[:k], add_generation_prompt=True)
        assert full[: len(prompt)] == prompt, f"prefix of {k} messages changed when the conversation grew"
    assert full.count(2) == len(chat)  # one <|im_end|> per message


def test_tool_call_shaped_messages(family: HFFamily) -> None:
    tok = family.tokenizer
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                               "parameters": {"type": "object", "properties": {}}}}]
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": "Add 17 and 25."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is "}, {"type": "text", "text": "42."}]},
    ]
    ids = tok.encode_chat(chat, add_generation_prompt=False, tools=tools)
    text = tok.decode(ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>' in text
    assert "tool\n42\n" in text and text.endswith("assistant\nIt is 42.\n")
    prompt = tok.encode_chat(chat[:1], add_generation_prompt=True, tools=tools)
    assert ids[: len(prompt)] == prompt
    with pytest.raises(ValueError, match="role"):
        tok.encode_chat([{"content": "x"}], add_generation_prompt=True)


def _random_text(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x2FF), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x10000, 0x1FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.mark.parametrize(
    "content",
    [
        "Ünïcödé, naïve café — “quotes” … ½ ≠ ∞",
        "你好，世界！これは日本語です。한국어도 됩니다.",
        "مرحبا بالعالم ‏שלום‎",
        "emoji 🎉👩🏽‍💻🇫🇷 and a ZWJ\u200d, tabs\tand\r\nnewlines\n\n  spaces  ",
        "e\u0301 combining, \x00\x07 control, \ufeff BOM, \U0010fffd plane 16",
        "",
    ],
)
def test_arbitrary_utf8_round_trips(family: HFFamily, content: str) -> None:
    tok = family.tokenizer
    ids = tok.encode_chat([{"role": "system", "content": "S"}, {"role": "user", "content": content}],
                          add_generation_prompt=False)
    assert tok.decode(ids) == f"system\nS\nuser\n{content}\n"


def test_random_utf8_round_trips(family: HFFamily) -> None:
    rng = random.Random(14)
    tok = family.tokenizer
    for _ in range(50):
        content = _random_text(rng, rng.randint(1, 40))
        ids = tok.encode_chat([{"role": "system", "content": "S"}, {"role": "user", "content": content}],
                              add_generation_prompt=False)
        assert tok.decode(ids) == f"system\nS\nuser\n{content}\n", ascii(content)


# ------------------------------------------------------------------ HF policy and checkpoints


def test_token_logprobs_do_not_depend_on_padding(family: HFFamily) -> None:
    model = family.new_model(0, CPU)
    a = family.tokenizer.encode_chat(_conversation()[:2], add_generation_prompt=True)
    b = family.tokenizer.encode_chat(_conversation()[:4], add_generation_prompt=True)
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    pad = len(long_) - len(short)
    with torch.no_grad():
        alone_short = token_logprobs(model, torch.tensor([short]))[0]
        alone_long = token_logprobs(model, torch.tensor([long_]))[0]
        right = torch.tensor([short + [0] * pad, long_])
        right_mask = torch.tensor([[1] * len(short) + [0] * pad, [1] * len(long_)])
        left = torch.tensor([[0] * pad + short, long_])
        left_mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long_)])
        by_right = token_logprobs(model, right, 0.8, right_mask)
        by_left = token_logprobs(model, left, 0.8, left_mask)
        no_mask = token_logprobs(model, right, 0.8)
        alone_short_t = token_logprobs(model, torch.tensor([short]), 0.8)[0]
    assert by_right.dtype == torch.float32 and by_right.shape == (2, len(long_) - 1)
    assert torch.allclose(by_right[0, : len(short) - 1], alone_short_t, atol=1e-5)
    assert torch.allclose(by_left[0, pad:], alone_short_t, atol=1e-5)
    assert torch.allclose(by_left[1], by_right[1], atol=1e-5)
    assert torch.allclose(no_mask[0, : len(short) - 1], alone_short_t, atol=1e-5)  # causal: right pad is invisible
    assert not torch.allclose(alone_short_t, alone_short[: len(short) - 1])  # temperature is applied
    assert alone_long.shape == (len(long_) - 1,)


def test_checkpoint_round_trip_with_digest(family: HFFamily, tmp_path: Path) -> None:
    model = family.new_model(0, CPU)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # not the directory's weights any more
    target = tmp_path / "weights" / "v7"
    digest = family.save(model, target, version="v7", step=7)
    assert digest == family.digest(model)
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", SIDECAR} <= names
    assert json.loads((target / SIDECAR).read_text()) == {"format": 1, "version": "v7", "step": 7, "digest": digest}
    config = json.loads((target / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "rope_theta" in config  # readable by older transformers
    assert sorted(p.name for p in target.parent.iterdir()) == ["v7"]  # no temp dir left behind

    loaded = family.load(target, CPU)
    assert (loaded.version, loaded.step, loaded.digest) == ("v7", 7, digest)
    assert family.digest(loaded.model) == digest
    ids = torch.tensor([family.tokenizer.encode_chat(_conversation(), add_generation_prompt=True)])
    with torch.no_grad():
        assert torch.equal(token_logprobs(loaded.model, ids), token_logprobs(model, ids))

    family.save(model, target, version="v7", step=7)  # a retrained step overwrites its directory
    assert family.load(target, CPU).digest == digest
    assert sorted(p.name for p in target.parent.iterdir()) == ["v7"]


def test_checkpoint_load_refuses_bad_directories(family: HFFamily, tmp_path: Path) -> None:
    model = family.new_model(0, CPU)
    target = tmp_path / "v1"
    family.save(model, target, version="v1", step=1)
    meta = json.loads((target / SIDECAR).read_text())
    (target / SIDECAR).write_text(json.dumps({**meta, "digest": "0" * 64}))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        family.load(target, CPU)
    (target / SIDECAR).unlink()
    with pytest.raises(CheckpointError, match=SIDECAR):
        family.load(target, CPU)
    with pytest.raises(FileNotFoundError):
        family.load(tmp_path / "missing", CPU)


def test_load_in_another_dtype_keeps_the_stored_digest(family: HFFamily, tmp_path: Path) -> None:
    model = family.new_model(0, CPU)
    digest = family.save(model, tmp_path / "v2", version="v2", step=2)
    loaded = family.load(tmp_path / "v2", CPU, dtype=torch.bfloat16)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.digest == digest != family.digest(loaded.model)


def test_gradient_checkpointing_gives_the_same_gradients(family: HFFamily) -> None:
    ids = torch.tensor([family.tokenizer.encode_chat(_conversation(), add_generation_prompt=True)])
    grads = []
    for enabled in (False, True):
        model = family.new_model(0, CPU)
        assert set_gradient_checkpointing(model, enabled) is enabled
        model.train()
        token_logprobs(model, ids).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


# ------------------------------------------------------------------ GGUF conversion cache


def test_gguf_conversion_is_keyed_by_size_and_sha(tmp_path: Path, smollm2_dir: Path) -> None:
    source = json.loads((smollm2_dir / "rein-source.json").read_text())
    assert source["name"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(source["sha256"]) == 64
    assert is_converted(smollm2_dir, source)
    assert not is_converted(smollm2_dir, {**source, "sha256": "0" * 64})
    assert not is_converted(tmp_path, source)
    fake = tmp_path / "Some-Model.Q8_0.gguf"
    fake.write_bytes(b"GGUF not really")
    key = source_key(fake)
    assert key["size"] == 15 and default_target(fake, key, tmp_path).name == f"some-model.q8_0-{key['sha256'][:12]}"
    with pytest.raises(ModelError, match="cannot convert"):
        load_family(str(fake), cache_dir=tmp_path)
    assert not any((tmp_path / "models").glob("some-model*"))  # nothing half-written left as a model
