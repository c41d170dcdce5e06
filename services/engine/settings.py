"""Engine settings (``REIN_*`` environment variables); built once in ``__main__``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from shared.settings import ModelServiceSettings, ReplicaSettings


class EngineSettings(ModelServiceSettings, ReplicaSettings):
    """Settings of ``python -m services.engine``.

    With ``REIN_ADVERTISE_URL`` (``http://{ip}:30000``) the engine registers itself in Redis once its
    model is loaded: proxies with ``REIN_DISCOVER_ENGINES`` route sessions to it and the broadcaster
    updates it, with no list of engines to keep."""

    host: str = "127.0.0.1"
    """Interface the HTTP server binds (0.0.0.0 inside a container)."""
    port: int = Field(default=30000, ge=1, le=65535)
    """HTTP port; 30000 is SGLang's default so clients need no change."""
    weights_dir: Path = Path("weights")
    """Directory checkpoints are loaded from; ``/update_weights_from_disk`` refuses any path outside it."""
    model_path: Path | None = None
    """Checkpoint loaded at start (inside ``weights_dir``; relative paths are taken relative to it).
    Unset: a fresh policy is initialised from ``seed`` and labelled ``initial_version``."""
    seed: int = 0
    """Seed of the initial weights (when no ``model_path``) and of the sampler's random generator."""
    initial_version: str = "v0"
    """Weight version label reported for seed-initialised weights."""
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    """Where the policy runs; ``auto`` picks CUDA when available."""
    torch_threads: int = Field(default=1, ge=1)
    """``torch.set_num_threads`` for this process: keeps the engine from starving co-located services."""
    max_batch_size: int = Field(default=256, ge=1)
    """Most requests decoded in one batched step; extra requests wait for a free slot (FIFO)."""
    kv_budget_tokens: int = Field(default=65536, ge=1)
    """KV cache positions the decoder may hold (``REIN_KV_BUDGET_TOKENS``), counted as rows x the
    longest row's reservation (prompt + max_new_tokens). Requests that do not fit wait in the queue;
    one that alone exceeds it is refused (400)."""
    prefill_padding: float = Field(default=0.0, ge=0.0, le=1.0)
    """Most share of a prefill forward's positions that may be padding (``REIN_PREFILL_PADDING``): prompts
    of different lengths starting together share a left-padded forward within it. 0 (the decoder's
    ``MAX_PADDING``) batches equal lengths only (on CPU padding costs about its share:
    docs/benchmarks.md); 1 prefills all in one forward."""
    step_delay_s: float = Field(default=0.0, ge=0.0)
    """Sleep between decode steps. Tests set it to make generations slow enough to pause mid-flight."""
    stage_weights: bool = True
    """Serve ``/stage_weights``: read the next checkpoint while serving, so the update inside a pause
    only swaps it in. Holds a second copy of the weights on the device meanwhile; ``false`` for a
    model whose second copy does not fit (the route then answers 404, as SGLang's would, and the
    broadcaster stops asking)."""
    max_request_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Largest HTTP request body accepted; larger ones get 413 before being parsed."""

    @model_validator(mode="after")
    def _model_path_inside_weights_dir(self) -> EngineSettings:
        if self.model_path is None:
            return self
        root = self.weights_dir.resolve()
        path = self.model_path if self.model_path.is_absolute() else self.weights_dir / self.model_path
        if not path.resolve().is_relative_to(root):
            raise ValueError(
                f"model_path {str(self.model_path)!r} must be inside weights_dir {str(root)!r} "
                "(REIN_MODEL_PATH / REIN_WEIGHTS_DIR)"
            )
        return self

    def resolved_model_path(self) -> Path | None:
        """``model_path`` as an absolute, symlink-resolved path (None when unset)."""
        if self.model_path is None:
            return None
        path = self.model_path if self.model_path.is_absolute() else self.weights_dir / self.model_path
        return path.resolve()
