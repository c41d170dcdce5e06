"""Trainer settings (``REIN_*`` environment variables); built once in ``__main__``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from services.trainer.loss_settings import LossSettings
from shared.policy import PolicyConfig
from shared.settings import ModelServiceSettings, StopSettings


class TrainerSettings(ModelServiceSettings, StopSettings, LossSettings):
    """Settings of ``python -m services.trainer``; the step's own knobs (optimizer, loss, correction) are those
    of :class:`~services.trainer.loss_settings.LossSettings`."""

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
    init_weights: Path | None = None
    """A checkpoint of this model family (a tiny policy's ``v<k>.pt``, an HF step's directory, as a trainer
    writes them) taken as the step-0 weights at first start, instead of a fresh model (tiny: from ``seed``;
    HF: the pretrained weights): a warm start, e.g. from a short run that learned the task's format, so
    that the runs compared start from one policy. The optimizer starts fresh. Ignored on a resume."""

    model_context: int = Field(default=PolicyConfig.context, ge=2)
    """Context window of the step-0 tiny policy (ignored once a checkpoint exists: its config rules)."""
    model_width: int = Field(default=PolicyConfig.width, ge=1)
    """Width of the step-0 tiny policy (HF models: their config rules)."""
    model_layers: int = Field(default=PolicyConfig.layers, ge=1)
    """Layers of the step-0 tiny policy."""
    model_heads: int = Field(default=PolicyConfig.heads, ge=1)
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

    nonlast_version_tokens: Literal["mask", "weight"] = "mask"
    """Token-level staleness control for a sample's tokens of an older version
    than its last trainable one: ``mask`` leaves them out of the loss; ``weight`` trains them, each against its
    own behaviour logprob, weighted by the importance weight of ``offpolicy_correction`` (under ``none`` and
    ``geo_mask``: PPO's clipped ratio)."""
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
        if self.model_width % self.model_heads:
            raise ValueError(
                f"model_width ({self.model_width}) must be divisible by model_heads ({self.model_heads}) "
                "(REIN_MODEL_WIDTH / REIN_MODEL_HEADS)"
            )
        if self.init_weights is not None and not self.init_weights.exists():
            raise ValueError(f"init_weights {self.init_weights} does not exist (REIN_INIT_WEIGHTS)")
        return self

    def tiny_policy(self, vocab_size: int) -> PolicyConfig:
        """The step-0 tiny policy's shape these settings give (its defaults are :class:`PolicyConfig`'s)."""
        return PolicyConfig(vocab_size=vocab_size, context=self.model_context, width=self.model_width,
                            layers=self.model_layers, heads=self.model_heads)
