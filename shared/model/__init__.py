"""The model layer: one interface over the built-in tiny policy and Hugging Face causal LMs.

``REIN_MODEL`` (one setting shared by engine, proxy and trainer) picks the family:

- ``tiny`` (default): the built-in policy (``shared.policy`` + ``shared.tokenizer``);
- a Hugging Face directory (``config.json``, weights, tokenizer files);
- a ``.gguf`` file: converted once into ``<cache>/models/<name>-<sha12>/`` and loaded from there.

Nothing outside this package knows which family it serves: callers use :class:`ModelFamily`, and
:mod:`shared.model.compute` (:func:`~shared.model.compute.logits`,
:func:`~shared.model.compute.token_logprobs`, ...). Importing the package imports neither torch nor
transformers: the proxy needs a tokenizer only (:func:`load_tokenizer`; the tiny one is plain Python), and
a family imports what it needs when it is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from shared.policy import PolicyConfig

__all__ = [
    "ChatTokenizer",
    "CheckpointError",
    "Loaded",
    "ModelError",
    "ModelFamily",
    "Turn",
    "UnrenderableMessages",
    "load_family",
    "load_tokenizer",
    "state_digest",
]

TINY = "tiny"


def load_family(spec: str, *, cache_dir: Path | None = None, tiny_config: PolicyConfig | None = None) -> ModelFamily:
    """The family ``spec`` names: ``tiny``, an HF directory or a ``.gguf`` file (converted once).

    ``cache_dir`` (default ``${REIN_CACHE:-~/.cache/rein}``) holds converted GGUF models;
    ``tiny_config`` shapes the tiny policy (default: :class:`PolicyConfig`'s defaults).
    Raises ModelError when ``spec`` names nothing loadable.
    """
    if spec == TINY:
        from shared.model.tiny import TinyFamily

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


def load_tokenizer(spec: str, *, cache_dir: Path | None = None) -> ChatTokenizer:
    """The tokenizer and chat template of the family ``spec`` names, without its weights (the proxy's need):
    for ``tiny`` without importing torch."""
    if spec == TINY:
        from shared.model.tiny_chat import TinyChatTokenizer

        return TinyChatTokenizer()
    return load_family(spec, cache_dir=cache_dir).tokenizer
