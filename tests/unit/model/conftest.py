"""The model tests' ``hf`` fixture: SmolLM2's real tokenizer with its ChatML template (only the tokenizer is
loaded), made once per test module."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model.hf import HFFamily
from shared.model.hf_chat import HFChatTokenizer


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path) -> HFChatTokenizer:
    tokenizer = HFFamily(smollm2_dir).tokenizer
    assert isinstance(tokenizer, HFChatTokenizer)
    return tokenizer
