"""The model layer's interface: what engine, proxy and trainer may know about a model.

Two families implement it (:mod:`shared.model.tiny`, :mod:`shared.model.hf`); callers
get one from :func:`shared.model.load_family` and never ask which it is. Checkpoints
carry a version, a step and a device-independent digest; a load verifies the digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from shared.checkpoint import CheckpointError
from shared.checkpoint import digest as checkpoint_digest
from shared.model.chat import ChatTokenizer, ModelError, Turn, UnrenderableMessages

if TYPE_CHECKING:  # the interface names torch types; only the families that hold weights import it
    import torch
    from torch import nn

__all__ = [
    "ChatTokenizer", "CheckpointError", "Loaded", "ModelError", "ModelFamily", "Turn", "UnrenderableMessages",
    "state_digest",
]


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back and verified: its model (on the requested device) and identity."""

    model: nn.Module
    version: str
    step: int
    digest: str
    """Digest of the weights as stored (before any cast to the device's dtype)."""


class ModelFamily(Protocol):
    """One model: tokenizer, fresh weights, checkpoint format."""

    @property
    def name(self) -> str:
        """``tiny`` or the Hugging Face directory's name."""
        ...

    @property
    def kind(self) -> Literal["tiny", "hf"]: ...

    @property
    def tokenizer(self) -> ChatTokenizer: ...

    @property
    def context_window(self) -> int:
        """Longest sequence (prompt + generation) the model accepts, in tokens."""
        ...

    @property
    def checkpoint_suffix(self) -> str:
        """Suffix of a checkpoint's name: ``.pt`` (a file) for tiny, ``""`` (a directory) for HF."""
        ...

    def new_model(self, seed: int, device: torch.device, *, dtype: torch.dtype | None = None) -> nn.Module:
        """tiny: fresh weights from ``seed``; hf: the directory's pretrained weights (seed ignored).

        Returned in eval mode on ``device``, in ``dtype`` (default: fp32 on CPU; HF models in bf16 on
        CUDA; the trainer asks for fp32 master weights).
        """
        ...

    def save(self, model: nn.Module, path: Path, *, version: str, step: int) -> str:
        """Write a checkpoint atomically at ``path``; returns its digest."""
        ...

    def load(self, path: Path, device: torch.device, *, dtype: torch.dtype | None = None) -> Loaded:
        """Read and verify a checkpoint onto ``device`` (``dtype`` as for :meth:`new_model`).

        Raises CheckpointError (unreadable, malformed, digest mismatch) or FileNotFoundError.
        """
        ...

    def digest(self, model: nn.Module) -> str:
        """Device-independent digest of the model's weights (same weights, same dtype: same digest)."""
        ...


state_digest = checkpoint_digest
"""sha256 over ``key, dtype, shape, bytes`` of each tensor in sorted key order (both families)."""
