"""What engine and trainer compute with a model of either family: logits, features, per-token logprobs,
the context window and gradient checkpointing. Torch lives here and in the families, not in the package
import: the proxy reads only a tokenizer and does not load torch (:func:`shared.model.load_tokenizer`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shared.model.base import ModelFamily
from shared.model.sampling import LOGPROB_FLOOR, SamplingTensors, sampling_logprobs
from shared.policy import TinyPolicy

SPLIT_HEAD_CLASSES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
    "Phi3ForCausalLM", "Olmo2ForCausalLM", "SmolLM3ForCausalLM", "Starcoder2ForCausalLM",
})
"""Transformers causal LMs whose logits are exactly ``lm_head(base_model(...).last_hidden_state)`` (their
``forward`` read in transformers 5.25), so :func:`features` may split the head off. Others change the logits
after the head (Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``)
or have not been read: they take the full path. A tied head is the embedding module itself: nothing differs."""


def _hf_inputs(ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[str, Any]:
    if attention_mask is None:
        return {"input_ids": ids, "use_cache": False}
    mask = attention_mask.to(torch.long)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "use_cache": False}


def logits(model: nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T] -> [B, T, V]``: position ``t`` predicts token ``t + 1``.

    ``attention_mask`` (1 = real token) lets HF models take left or right padding; positions
    are counted over real tokens only, so a row's logits do not depend on its padding. The
    tiny policy has absolute positions and accepts right padding only (causal attention
    keeps it invisible), so it ignores the mask.
    """
    if isinstance(model, TinyPolicy):
        out: torch.Tensor = model(ids)
        return out
    return model(**_hf_inputs(ids, attention_mask)).logits  # type: ignore[no-any-return]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def features(
    model: nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """What the LM head reads at each position, and the head: ``head(features)`` is :func:`logits`.

    The tiny policy (unless a subclass overrides its ``forward``) and the classes of
    :data:`SPLIT_HEAD_CLASSES` give their last hidden states ``[B, T, H]`` and head, so a caller that
    needs logits at a few positions pays the ``H x V`` head there only. Any other model gives its
    logits ``[B, T, V]`` and the identity.
    """
    if isinstance(model, TinyPolicy) and type(model).forward is TinyPolicy.forward:
        return model.hidden(ids), model.head
    cls = type(model)
    if cls.__name__ in SPLIT_HEAD_CLASSES and cls.__module__.startswith("transformers.models."):
        head = model.get_output_embeddings()  # type: ignore[operator]
        base = model.base_model
        if isinstance(head, nn.Module) and isinstance(base, nn.Module) and base is not model:
            return base(**_hf_inputs(ids, attention_mask)).last_hidden_state, head
    return logits(model, ids, attention_mask), _identity


def token_logprobs(
    model: nn.Module, ids: torch.Tensor, temperature: float = 1.0, attention_mask: torch.Tensor | None = None, *,
    sampling: SamplingTensors | None = None, where: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probability of ``ids[:, 1:]`` given each prefix: ``[B, T] -> [B, T-1]`` (fp32).

    Without ``sampling``: ``log_softmax(logits / temperature)``. With it (each ``[B, T-1]``): the log
    of each token's probability under its own sampling parameters
    (:func:`~shared.model.sampling.sampling_logprobs`), which is what the engine reports as
    ``output_token_logprobs``, so trainer and sampler agree; a token the filter excludes scores
    :data:`~shared.model.sampling.LOGPROB_FLOOR`. Padded positions are meaningless; callers mask them.

    ``where`` (bool ``[B, T-1]``): the tokens to score; every other entry is 0 and has no gradient.
    The head (where :func:`features` splits it off), the softmax and the sampling filter then run at
    those positions only: a loss needs its trained tokens, often a fraction of a multi-turn sample,
    not ``T x V`` logits. The scored values and the gradients are those of ``where=None`` (up to the
    rounding of a differently shaped matmul).
    """
    return _score(model, ids, temperature, attention_mask, sampling, where, entropy=False)[0]


def token_logprobs_and_entropy(
    model: nn.Module, ids: torch.Tensor, temperature: float = 1.0, attention_mask: torch.Tensor | None = None, *,
    sampling: SamplingTensors | None = None, where: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` and, at the same positions, the entropy (nats) of the distribution each
    token was sampled from (after temperature and the sampling filter): both ``[B, T-1]`` fp32, 0
    outside ``where``. Both carry the gradient (the trainer's entropy bonus differentiates it)."""
    logp, ent = _score(model, ids, temperature, attention_mask, sampling, where, entropy=True)
    assert ent is not None
    return logp, ent


def _score(
    model: nn.Module,
    ids: torch.Tensor,
    temperature: float,
    attention_mask: torch.Tensor | None,
    sampling: SamplingTensors | None,
    where: torch.Tensor | None,
    *,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    feats, head = features(model, ids, attention_mask)
    targets = ids[:, 1:]
    b, t = targets.shape
    if where is None:
        full = head(feats)[:, :-1]
        out = full.reshape(b * t, full.shape[-1]).float()
        keep = torch.ones_like(targets, dtype=torch.bool)
        picked = targets.reshape(-1)
    else:
        if where.shape != targets.shape:
            raise ValueError(f"where {tuple(where.shape)} must be {tuple(targets.shape)}")
        keep = where.to(torch.bool)
        out = head(feats[:, :-1][keep]).float()
        picked = targets[keep]
    if sampling is None:
        dist = torch.log_softmax(out / temperature, dim=-1)
        logp = dist.gather(-1, picked[:, None]).squeeze(-1)
    else:
        dist = sampling_logprobs(out, sampling.temperature[keep], sampling.top_k[keep], sampling.top_p[keep])
        logp = dist.gather(-1, picked[:, None]).squeeze(-1).clamp(min=LOGPROB_FLOOR)
    ent = None
    if entropy:  # -sum p log p over the tokens the distribution keeps (a filtered token's p is 0)
        finite = torch.isfinite(dist)
        ent = -(dist.exp() * torch.where(finite, dist, torch.zeros_like(dist))).sum(-1)
    if where is None:
        return logp.reshape(b, t), None if ent is None else ent.reshape(b, t)
    return (logp.new_zeros(b, t).masked_scatter(keep, logp),
            None if ent is None else ent.new_zeros(b, t).masked_scatter(keep, ent))


def context_window_of(family: ModelFamily, model: nn.Module) -> int:
    """The longest sequence ``model`` accepts: a tiny checkpoint's own context rules over the family's."""
    if isinstance(model, TinyPolicy):
        return model.config.context
    return family.context_window


def set_gradient_checkpointing(model: nn.Module, enabled: bool) -> bool:
    """Recompute activations in the backward pass (less memory, ~30 % more compute) where the model
    supports it (HF models); returns whether it is now on. The tiny policy is small enough not to need it."""
    if isinstance(model, TinyPolicy):
        return False
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        if enabled:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]
        else:
            model.activation_checkpointing_disable()  # type: ignore[operator]
    elif enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    else:
        model.gradient_checkpointing_disable()  # type: ignore[operator]
    return enabled
