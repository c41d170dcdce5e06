"""Session fixtures for Hugging Face model tests (registered in ``tests/conftest.py``).

- ``smollm2_dir -> Path``: the converted SmolLM2-135M-Instruct directory in the cache; the first
  run of a machine makes it with ``deploy/smollm2.sh`` (download + conversion, ~2 minutes), every
  later run finds it at once.
- ``tiny_llama_dir -> Path``: a randomly initialised Llama (hidden 64, 2 layers, 4 heads) with the
  SmolLM2 tokenizer and its vocabulary, saved as an HF directory: real tokenizer and chat template,
  model code paths of a real Llama, and a forward pass that takes milliseconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    done = subprocess.run(
        ["bash", str(REPO / "deploy" / "smollm2.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"deploy/smollm2.sh failed ({done.returncode}):\n{done.stderr[-3000:]}")
    path = Path(done.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file(), path
    return path


def make_tiny_llama(tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """A random tiny Llama with ``tokenizer_dir``'s tokenizer, saved into ``out``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from shared.model.hf import finish_directory

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=eos, pad_token_id=eos,
                         tie_word_embeddings=True, **TINY_LLAMA)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    finish_directory(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(smollm2_dir, tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")
