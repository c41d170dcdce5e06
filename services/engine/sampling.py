"""How the engine picks each request's next token and tells that a stop string is complete.

Per-request parameters (:class:`SamplingParams`), one batched draw with per-row parameters
(:func:`sample_next`, over :func:`shared.model.sampling.sampling_logprobs`, the distribution the
trainer recomputes) and stop strings matched across token boundaries (:func:`completes_stop`);
:class:`~services.engine.batcher.Batcher` applies them at each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shared.model.sampling import sampling_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy; ``top_k <= 0`` disables top-k."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    """Stop strings (SGLang's ``stop``): generation ends with the token that completes one (kept in the
    output). A string is matched in the text of the input's tail and the output, ending in the newest
    token, so one cut by a preempt between two requests is found in the second."""


def completes_stop(
    ids: Sequence[int], new: int, stops: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> str | None:
    """The stop string that the last ``new`` tokens of ``ids`` complete (None when none does): it occurs
    in the text of the tail of ``ids``, and ends past the text that came before those tokens."""
    if not stops or new <= 0:
        return None
    window = max(len(s) for s in stops) + new + 2  # a token is at least one character, or part of one
    tail = list(ids[-window:])
    before, after = decode(tail[:-new]), decode(tail)
    for stop in stops:
        at = after.find(stop, max(0, len(before) - len(stop) + 1))
        if at != -1 and at + len(stop) > len(before):
            return stop
    return None


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits[B, V]`` with per-row parameters.

    Returns ``(tokens[B], logprobs[B])``: each token is drawn from the row's sampling
    distribution (:func:`shared.model.sampling.sampling_logprobs`: temperature, then top-k,
    then top-p; greedy for ``T <= 0``) and its logprob is the log of the probability that
    distribution gave it (0.0 for a greedy token), which is what the trainer recomputes
    from the parameters the chunk records.
    """
    logp = sampling_logprobs(logits, temperature, top_k, top_p)
    if bool((temperature <= 0).all()):
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
