"""The built-in tiny policy: a small decoder-only transformer (nanoGPT-style).

Pure model code: a dataclass config, an ``nn.Module`` whose forward maps token ids
to logits, and :func:`token_logprobs` used by the trainer and the engine. No I/O,
no device hard-coded: callers move the module where they want it.

With the defaults (vocab 54, context 64, width 64, 2 layers, 4 heads) the model has
about 111k parameters — small enough to sample and train on two CPU cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

KV = tuple[torch.Tensor, torch.Tensor]
"""One layer's cached keys and values, each ``[B, heads, S, head_dim]``."""


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of the tiny policy. Stored in every checkpoint."""

    vocab_size: int
    context: int = 64
    width: int = 64
    layers: int = 2
    heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "width", "layers", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PolicyConfig.{name} must be positive, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"PolicyConfig.width ({self.width}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"PolicyConfig.dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolicyConfig:
        return cls(**data)


class _Attention(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.proj(y)
        return out

    def step(
        self, x: torch.Tensor, past: KV | None, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, KV]:
        """Attention over ``past`` keys/values plus ``x``'s own; returns ``(y, (k, v))`` of all of them.

        ``key_mask[B, S]`` (S = past + new positions) marks real keys; padding is False.
        Without a past and a mask this is :meth:`forward`'s computation exactly.
        """
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        if key_mask is None and past is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = k.shape[2]
            allowed = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
            if key_mask is not None:
                allowed = allowed & key_mask.bool()[:, None, None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.proj(y)
        return out, (k, v)


class _Block(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width),
            nn.GELU(),
            nn.Linear(4 * cfg.width, cfg.width),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x

    def step(self, x: torch.Tensor, past: KV | None, key_mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        y, kv = self.attn.step(self.ln1(x), past, key_mask)
        x = x + y
        x = x + self.mlp(self.ln2(x))
        return x, kv


class TinyPolicy(nn.Module):
    """Causal transformer: ``forward(ids[B,T]) -> logits[B,T,V]``, i.e. ``head(hidden(ids))``.

    Position ``t`` of the logits predicts token ``t+1``. Causal attention means right
    padding never influences earlier positions, so batches may be right-padded.
    """

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.width)
        self.pos_emb = nn.Embedding(config.context, config.width)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.hidden(ids))
        return logits

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, T] -> [B, T, width]``: what :attr:`head` maps to logits, so a caller that needs the
        logits at a few positions applies the head there only (``forward`` is ``head(hidden(ids))``)."""
        _, t = ids.shape
        if t > self.config.context:
            raise ValueError(f"sequence length {t} exceeds the context window {self.config.context}")
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.ln_f(x)
        return out

    def forward_cached(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        past: Sequence[KV] | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Incremental forward: ``ids[B,T]`` at ``positions[B,T]`` after ``past`` keys/values.

        ``past`` holds one ``(k, v)`` pair ``[B, heads, S, head_dim]`` per layer; ``key_mask[B, S+T]``
        marks real (not padding) keys. Returns the logits ``[B,T,V]`` and every layer's keys/values
        including the new positions. Without a past or mask, the logits are :meth:`forward`'s.
        """
        if int(positions.max()) >= self.config.context:
            raise ValueError(f"position {int(positions.max())} exceeds the context window {self.config.context}")
        x = self.drop(self.tok_emb(ids) + self.pos_emb(positions))
        new: list[KV] = []
        for i, block in enumerate(self.blocks):
            x, kv = cast(_Block, block).step(x, None if past is None else past[i], key_mask)
            new.append(kv)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits, new


def token_logprobs(model: TinyPolicy, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of ``ids[:, 1:]`` given each prefix: ``[B, T] -> [B, T-1]``.

    Uses ``log_softmax(logits / temperature)`` — the same quantity the engine reports
    as ``output_token_logprobs`` — so trainer and sampler agree. Entries at padded
    positions are meaningless; callers mask them.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    logits = model(ids)[:, :-1, :].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def init_policy(config: PolicyConfig, seed: int) -> TinyPolicy:
    """A freshly initialised policy on CPU; identical weights for the same seed.

    Uses a private generator state (``torch.random.fork_rng``) so the global RNG of
    the caller is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyPolicy(config)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``auto`` (CUDA when available); asking for CUDA without it is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("REIN_DEVICE=cuda but CUDA is not available")
    return torch.device(name)
