"""The sampling distribution of a request, one copy for the engine and the trainer.

A token is drawn from ``softmax(logits / T)`` restricted to the top-k tokens, then to the
smallest prefix of that renormalised distribution whose mass reaches top-p (always at least
one token), renormalised again; ``T <= 0`` is greedy (the argmax, with probability 1).
:func:`sampling_logprobs` is the log of that distribution, so the engine's reported logprob of
a sampled token is the probability the behaviour policy actually gave it, and the trainer,
scoring the same token with the same parameters, gets an importance ratio that carries
staleness alone (not the temperature or the filter). Tokens outside the kept set have
``-inf``; under the weights that sampled them no sampled token does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LOGPROB_FLOOR = -100.0
"""What the trainer scores a token its own filter excludes (probability ~0, no gradient): a finite
stand-in for ``-inf`` that keeps ratios and statistics finite."""


NO_TOP_K = -1
"""``top_k`` that keeps the whole vocabulary (any value <= 0 does)."""


class SamplingTensors(NamedTuple):
    """Per-position sampling parameters of a batch (each ``[B, T]``, aligned to the scored tokens)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


def filtering(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows whose parameters remove tokens (top-k below the vocabulary, or top-p below 1)."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)


def kept_tokens(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` bool: the tokens each row's top-k, then top-p, keeps (of temperature-scaled logits)."""
    n, v = scaled.shape
    sorted_vals, sorted_idx = torch.sort(scaled.detach().float(), dim=-1, descending=True)
    ranks = torch.arange(v, device=scaled.device).expand(n, v)
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    removed = ranks >= k[:, None]
    probs = torch.softmax(sorted_vals.masked_fill(removed, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    removed |= mass_before >= top_p[:, None]
    removed[:, 0] = False
    keep = torch.empty_like(removed)
    keep.scatter_(-1, sorted_idx, ~removed)
    return keep


def sampling_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``[N, V]`` float32: the log-probability of every token under each row's sampling parameters
    (``temperature``, ``top_k``, ``top_p``: ``[N]``). Differentiable in ``logits`` (the trainer's
    gradient flows through the kept tokens; which tokens are kept is not differentiated)."""
    logits = logits.float()
    v = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    rows = filtering(top_k, top_p, v) & ~greedy
    if bool(rows.any()):
        keep = torch.ones_like(scaled, dtype=torch.bool)
        keep[rows] = kept_tokens(scaled[rows], top_k[rows], top_p[rows])
        scaled = scaled.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.any()):
        best = torch.nn.functional.one_hot(logits.argmax(dim=-1), v).bool()
        point = torch.zeros_like(logp).masked_fill(~best, float("-inf"))
        logp = torch.where(greedy[:, None], point, logp)
    return logp
