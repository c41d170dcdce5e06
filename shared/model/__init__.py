"""The model layer: one interface over the built-in tiny policy and Hugging Face causal LMs.

``REIN_MODEL`` (one setting shared by engine, proxy and trainer) picks the family:

- ``tiny`` (default): the built-in policy (``shared.policy`` + ``shared.tokenizer``);
- a Hugging Face directory (``config.json``, weights, tokenizer files);
- a ``.gguf`` file: converted once into ``<cache>/models/<name>-<sha12>/`` and loaded from there.

Nothing outside this package knows which family it serves: callers use
:class:`ModelFamily`, :func:`logits` and :func:`token_logprobs`. Transformers is imported
only when an HF family is loaded, so the tiny path stays fast to import.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared.model.base import (
    ChatTokenizer,
    CheckpointError,
    Loaded,
    ModelError,
    ModelFamily,
    Turn,
    UnrenderableMessages,
    state_digest,
)
from shared.model.sampling import LOGPROB_FLOOR, SamplingTensors, sampling_logprobs
from shared.model.tiny import TinyFamily
from shared.policy import PolicyConfig, TinyPolicy

__all__ = [
    "ChatTokenizer",
    "CheckpointError",
    "Loaded",
    "ModelError",
    "ModelFamily",
    "SamplingTensors",
    "TinyFamily",
    "Turn",
    "UnrenderableMessages",
    "context_window_of",
    "load_family",
    "logits",
    "set_gradient_checkpointing",
    "state_digest",
    "token_logprobs",
]

TINY = "tiny"


def load_family(spec: str, *, cache_dir: Path | None = None, tiny_config: PolicyConfig | None = None) -> ModelFamily:
    """The family ``spec`` names: ``tiny``, an HF directory or a ``.gguf`` file (converted once).

    ``cache_dir`` (default ``${REIN_CACHE:-~/.cache/rein}``) holds converted GGUF models;
    ``tiny_config`` shapes the tiny policy (default: :class:`PolicyConfig`'s defaults).
    Raises ModelError when ``spec`` names nothing loadable.
    """
    if spec == TINY:
        return TinyFamily(tiny_config)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from shared.model.gguf import convert_cached

        path = convert_cached(path, cache_dir=cache_dir)
    elif not path.exists():
        raise ModelError(f"REIN_MODEL={spec!r}: expected 'tiny', a Hugging Face directory or a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelError(f"REIN_MODEL={spec!r}: {path} is no Hugging Face model directory (no config.json)")
    from shared.model.hf import HFFamily

    return HFFamily(path)


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
    if attention_mask is None:
        return model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]
    mask = attention_mask.to(torch.long)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits  # type: ignore[no-any-return]


def token_logprobs(
    model: nn.Module,
    ids: torch.Tensor,
    temperature: float = 1.0,
    attention_mask: torch.Tensor | None = None,
    *,
    sampling: SamplingTensors | None = None,
) -> torch.Tensor:
    """Log-probability of ``ids[:, 1:]`` given each prefix: ``[B, T] -> [B, T-1]`` (fp32).

    Without ``sampling``: ``log_softmax(logits / temperature)``. With it (each ``[B, T-1]``): the log
    of each token's probability under its own sampling parameters
    (:func:`~shared.model.sampling.sampling_logprobs`), which is what the engine reports as
    ``output_token_logprobs``, so trainer and sampler agree; a token the filter excludes scores
    :data:`~shared.model.sampling.LOGPROB_FLOOR`. Padded positions are meaningless; callers mask them.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    out = logits(model, ids, attention_mask)[:, :-1, :].float()
    targets = ids[:, 1:].unsqueeze(-1)
    if sampling is None:
        return torch.log_softmax(out / temperature, dim=-1).gather(-1, targets).squeeze(-1)
    b, t, v = out.shape
    logp = sampling_logprobs(
        out.reshape(b * t, v), sampling.temperature.reshape(-1), sampling.top_k.reshape(-1), sampling.top_p.reshape(-1)
    ).reshape(b, t, v)
    return logp.gather(-1, targets).squeeze(-1).clamp(min=LOGPROB_FLOOR)


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
