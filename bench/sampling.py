"""Replies sampled from a Hugging Face model as the proxy would render and end them, for the bench scripts
that ask what a model does on a task before any training (``tool_call_share``, ``task_signal``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.model.hf import HFFamily
from shared.model.hf_chat import HFChatTokenizer


@dataclass
class Sampler:
    """A model directory's tokenizer (the proxy's chat rendering and stop tokens) and its model, in float32."""

    tok: HFChatTokenizer
    model: Any
    pad: int

    @classmethod
    def load(cls, model_dir: Path) -> Sampler:
        from transformers import AutoModelForCausalLM

        tok = HFFamily(model_dir).tokenizer
        assert isinstance(tok, HFChatTokenizer), f"{model_dir} has no chat template"
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        pad = tok.inner.pad_token_id if tok.inner.pad_token_id is not None else min(tok.stop_ids)
        return cls(tok, model, pad)

    def replies(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[str]:
        """One reply per prompt (token ids of a rendered chat), generated together: sampled at ``temperature``
        (top-p 1, no top-k; 0: greedy) up to ``max_tokens`` tokens or the end of the turn; the text before it."""
        width = max(len(p) for p in prompts)
        batch = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = self.model.generate(batch, attention_mask=mask, do_sample=temperature > 0,
                                      temperature=temperature if temperature > 0 else None, top_p=1.0, top_k=0,
                                      max_new_tokens=max_tokens, eos_token_id=sorted(self.tok.stop_ids),
                                      pad_token_id=self.pad)
        stops = self.tok.stop_ids
        return [self.tok.decode([t for t in row if t not in stops and t != self.pad])
                for row in out[:, width:].tolist()]
