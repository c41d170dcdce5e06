"""Policy checkpoints: atomic writes, device-independent digests, verified loads.

A checkpoint is one torch file holding only plain data (so ``torch.load`` runs with
``weights_only=True``)::

    {"format": 1, "config": {...PolicyConfig...}, "state_dict": {name: tensor},
     "version": str, "step": int, "digest": "sha256 hex"}

The digest covers every tensor's key, dtype, shape and bytes (CPU, contiguous) in
sorted key order, so identical weights give identical digests on any device. The
trainer writes checkpoints with :func:`save`; engines read them with :func:`load`,
which recomputes the digest and refuses a file whose weights do not match it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.durable import atomic_write

if TYPE_CHECKING:  # torch only where a checkpoint is made or read: the proxy imports this module for its errors
    import torch

    from shared.policy import PolicyConfig, TinyPolicy

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, malformed or fails its digest check."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint."""

    model: TinyPolicy
    config: PolicyConfig
    version: str
    step: int
    digest: str


def digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over ``key, dtype, shape, bytes`` of each tensor in sorted key order."""
    import torch

    h = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().to("cpu").contiguous()
        h.update(key.encode())
        h.update(b"\0")
        h.update(str(tensor.dtype).encode())
        h.update(b"\0")
        h.update(repr(tuple(tensor.shape)).encode())
        h.update(b"\0")
        # view as bytes so every dtype (bf16 included) hashes without a numpy round trip
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _cpu_state(model: TinyPolicy) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def save(path: str | os.PathLike[str], model: TinyPolicy, config: PolicyConfig, version: str, step: int) -> str:
    """Write the checkpoint atomically (temp file in the same directory + ``os.replace``).

    Returns the digest. Readers never observe a partially written file.
    """
    import torch

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    state = _cpu_state(model)
    dig = digest(state)
    payload = {
        "format": FORMAT,
        "config": config.to_dict(),
        "state_dict": state,
        "version": str(version),
        "step": int(step),
        "digest": dig,
    }
    atomic_write(target, lambda fh: torch.save(payload, fh))
    return dig


def load(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> Checkpoint:
    """Read, verify and instantiate a checkpoint on ``device``.

    Raises FileNotFoundError for a missing file and CheckpointError for anything
    malformed or a digest mismatch.
    """
    import torch

    from shared.policy import PolicyConfig, TinyPolicy

    source = Path(path)
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch raises many types for a corrupt file; normalise them
        raise CheckpointError(f"cannot read checkpoint {source}: {exc}") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {source} is not a dict")
    missing = [k for k in ("config", "state_dict", "version", "step", "digest") if k not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {source} lacks {missing}")
    state = payload["state_dict"]
    actual = digest(state)
    if actual != payload["digest"]:
        raise CheckpointError(
            f"checkpoint {source} digest mismatch: file says {payload['digest']}, weights hash to {actual}"
        )
    try:
        config = PolicyConfig.from_dict(dict(payload["config"]))
        model = TinyPolicy(config)
        model.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {source} does not match its config: {exc}") from exc
    model.to(device)
    model.eval()
    return Checkpoint(
        model=model, config=config, version=str(payload["version"]), step=int(payload["step"]), digest=actual
    )
