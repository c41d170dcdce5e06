"""Trainer settings (``REIN_*`` environment variables); built once in ``__main__``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from shared.settings import ModelServiceSettings


class TrainerSettings(ModelServiceSettings):
    """Settings of ``python -m services.trainer``."""

    weights_dir: Path = Path("weights")
    """Where checkpoints ``v<step>.pt`` and their sidecars are written; the engines load from the same directory."""
    run_dir: Path = Path("runs/trainer")
    """Directory of ``metrics.jsonl`` (one JSON line per durable manifest: a step, or a batch skipped)."""
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    """Where the policy trains; ``auto`` picks CUDA when available."""
    torch_threads: int = Field(default=2, ge=1)
    """``torch.set_num_threads``: the tiny policy trains on two CPU cores, shared with the other services."""
    seed: int = 0
    """Seed of the step-0 weights written at first start (same seed, same ``v0`` digest)."""

    model_context: int = Field(default=64, ge=2)
    """Context window of the step-0 tiny policy (ignored once a checkpoint exists: its config rules)."""
    model_width: int = Field(default=64, ge=1)
    """Width of the step-0 tiny policy (HF models: their config rules)."""
    model_layers: int = Field(default=2, ge=1)
    """Layers of the step-0 tiny policy."""
    model_heads: int = Field(default=4, ge=1)
    """Attention heads of the step-0 tiny policy."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Forward-pass precision. Weights, AdamW state and checkpoints stay fp32 in every case; ``bf16`` runs
    the forward under bf16 autocast. ``auto``: bf16 for HF models on CUDA, fp32 otherwise (the tiny policy)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (HF models): less memory for ~30 % more compute.
    The tiny policy ignores it."""
    keep_checkpoints: int = Field(default=0, ge=0)
    """Keep only the newest N durable steps in ``weights_dir`` (an HF checkpoint is ~0.5 GB, its AdamW
    state twice that); 0 keeps all. Use 2 or more, so an engine loading the previous version finds it."""

    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate; 1e-3 learned the toy tasks best (3e-4 too slow, 3e-3 unstable)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW decoupled weight decay (torch's default, as in the measured prototype)."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip per step."""
    ppo_clip: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip ε on the trainer/rollout probability ratio."""
    is_truncation: float | None = Field(default=2.0)
    """Cap of the importance ratio for negative advantages (dual clip); must exceed 1 + ppo_clip. None: no cap."""
    normalize_std: bool = False
    """Divide GRPO advantages by the group's reward std; off because it destabilised the tiny policy."""
    mask_nonlast_version: bool = True
    """Token-level staleness control: train only tokens of a sample's last trainable version."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the rollouts: trainer logprobs are taken at the same temperature."""
    micro_batch_size: int = Field(default=0, ge=0)
    """Samples per forward/backward (gradient accumulation, token-mean kept exact). 0: the whole batch at once."""

    publish_every: int = Field(default=1, ge=1)
    """Checkpoint, publish a weight version and commit the manifest offsets every N steps."""
    max_steps: int = Field(default=0, ge=0)
    """Stop once the global step (= the newest checkpoint's step) reaches this; 0 runs until stopped.
    Batches skipped without an update (no gradient) are no step."""
    first_index: int = Field(default=0, ge=0)
    """Index of the first manifest the collector emits; the trainer waits for indices in order from here."""
    consumer_group: str = "rein-trainer"
    """Kafka consumer group of the ``train.batches`` consumer (its committed offsets are the resume point)."""
    poll_timeout_s: float = Field(default=0.5, gt=0)
    """Longest wait of one Kafka poll; bounds how fast a stop request is noticed."""
    fetch_timeout_s: float = Field(default=30.0, gt=0)
    """Bound on one fetch of a manifest's groups from ``rollout.groups``."""
    fetch_attempts: int = Field(default=5, ge=1)
    """Fetches of one manifest's groups before the trainer stops with an error: enough to ride out a
    broker restart, bounded so a reference that never resolves is loud."""

    metrics_host: str = "127.0.0.1"
    """Interface of the ``/metrics`` and ``/health`` HTTP server."""
    metrics_port: int = Field(default=9400, ge=0, le=65535)
    """Port of ``/metrics`` and ``/health``; 0 picks a free port (tests)."""

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if self.is_truncation is not None and self.is_truncation <= 1.0 + self.ppo_clip:
            raise ValueError(
                f"is_truncation ({self.is_truncation}) must exceed 1 + ppo_clip ({1.0 + self.ppo_clip}) "
                "(REIN_IS_TRUNCATION / REIN_PPO_CLIP)"
            )
        if self.model_width % self.model_heads:
            raise ValueError(
                f"model_width ({self.model_width}) must be divisible by model_heads ({self.model_heads}) "
                "(REIN_MODEL_WIDTH / REIN_MODEL_HEADS)"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas} (REIN_BETAS)")
        return self
