"""The built-in tiny policy as a model family: ``shared.policy``, ``shared.tokenizer`` and
``shared.checkpoint`` wrapped, unchanged, so ``REIN_MODEL=tiny`` behaves exactly as before."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from shared import checkpoint
from shared.model.base import ChatTokenizer, Loaded
from shared.model.tiny_chat import TinyChatTokenizer
from shared.policy import PolicyConfig, TinyPolicy, init_policy
from shared.tokenizer import TOKENIZER


class TinyFamily:
    """The tiny policy of shape ``config``; checkpoints are ``shared.checkpoint`` torch files."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig(vocab_size=TOKENIZER.vocab_size)
        self._tokenizer = TinyChatTokenizer()

    @property
    def name(self) -> str:
        return "tiny"

    @property
    def kind(self) -> Literal["tiny", "hf"]:
        return "tiny"

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def context_window(self) -> int:
        return self.config.context

    @property
    def checkpoint_suffix(self) -> str:
        return ".pt"

    def new_model(self, seed: int, device: torch.device, *, dtype: torch.dtype | None = None) -> nn.Module:
        model = init_policy(self.config, seed).to(device=device, dtype=dtype)
        model.eval()
        return model

    def save(self, model: nn.Module, path: Path, *, version: str, step: int) -> str:
        if not isinstance(model, TinyPolicy):
            raise TypeError(f"the tiny family saves TinyPolicy models, got {type(model).__name__}")
        return checkpoint.save(path, model, model.config, version, step)

    def load(self, path: Path, device: torch.device, *, dtype: torch.dtype | None = None) -> Loaded:
        ckpt = checkpoint.load(path, device)
        if dtype is not None:
            ckpt.model.to(dtype=dtype)
        return Loaded(model=ckpt.model, version=ckpt.version, step=ckpt.step, digest=ckpt.digest)

    def digest(self, model: nn.Module) -> str:
        return checkpoint.digest(model.state_dict())
