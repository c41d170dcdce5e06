"""Trainer settings (``REIN_*`` environment variables); built once in ``__main__``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from services.trainer.corrections import CORRECTIONS
from shared.settings import ModelServiceSettings, StopSettings


class TrainerSettings(ModelServiceSettings, StopSettings):
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
    """PPO clip ε: on the trainer/rollout probability ratio (corrections ``none``, ``geo_mask``), else on the
    current/proximal ratio."""
    is_truncation: float | None = Field(default=2.0)
    """Cap of the importance ratio for negative advantages (dual clip; corrections ``none`` and ``geo_mask``, the
    others bound their own weight); must exceed 1 + ppo_clip. None: no cap."""
    normalize_std: bool = False
    """Divide GRPO advantages by the group's reward std; off because it destabilised the tiny policy."""
    epochs: int = Field(default=1, ge=1)
    """Optimizer steps per batch (PPO's epochs): each a pass over the whole batch, the passes after the first
    on weights already moved from the rollout's, so the PPO clip bounds how far. The batch still makes one
    version; statistics are the first pass's."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus: the loss subtracts ``entropy_coef`` x the token-mean entropy of the policy
    over trained tokens (``services/trainer/loss.py``, ``entropy_bonus``), which keeps a policy trained from
    scratch exploring. 0: no bonus, and the entropy is not even scored."""
    nonlast_version_tokens: Literal["mask", "weight"] = "mask"
    """Token-level staleness control for a sample's tokens of an older version
    than its last trainable one: ``mask`` leaves them out of the loss; ``weight`` trains them, each against its
    own behaviour logprob, weighted by the importance weight of ``offpolicy_correction`` (under ``none`` and
    ``geo_mask``: PPO's clipped ratio)."""
    offpolicy_correction: Annotated[str, CORRECTIONS] = "none"
    """Off-policy correction of the loss, by its name in ``services.trainer.corrections.CORRECTIONS``
    (docs/architecture.md, "Off-policy corrections in the loss"); ``none`` is PPO-clip on the trainer/rollout
    ratio. Each logs the share of trained tokens it masked or clipped and the weights' ESS."""
    tis_cap: float = Field(default=2.0, ge=1.0)
    """C of ``tis`` and ``decoupled``: the behaviour importance weight is min(ratio, C) (slime's and verl's 2.0)."""
    icepop_band: tuple[float, float] = (0.5, 5.0)
    """[low, high] of ``icepop``: tokens whose trainer/rollout ratio lies outside leave the loss (verl's
    ``0.5_5.0``). JSON, e.g. ``[0.5, 5.0]``; low <= 1 <= high."""
    geo_mask_band: tuple[float, float] = (0.5, 2.0)
    """[low, high] of ``geo_mask`` for a sample's geometric-mean ratio over its trained tokens (slime's
    bounds 0.5 / 2.0); low <= 1 <= high."""
    m2po_threshold: float = Field(default=0.04, gt=0)
    """τ of ``m2po``: tokens with the largest squared log-ratio leave the loss until the batch's mean squared
    log-ratio is at most τ (AReaL's example 0.04)."""
    temperature: float = Field(default=1.0, gt=0)
    """Temperature of tokens whose chunks recorded no sampling parameters (records older than that field).
    Every chunk the proxy publishes records its own temperature, top-p and top-k, which the trainer uses."""
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
        for name, band in (("REIN_ICEPOP_BAND", self.icepop_band), ("REIN_GEO_MASK_BAND", self.geo_mask_band)):
            if not 0.0 <= band[0] <= 1.0 <= band[1]:  # ratio 1 (on-policy) is always in the band
                raise ValueError(f"{name} {band} must satisfy 0 <= low <= 1 <= high")
        if self.model_width % self.model_heads:
            raise ValueError(
                f"model_width ({self.model_width}) must be divisible by model_heads ({self.model_heads}) "
                "(REIN_MODEL_WIDTH / REIN_MODEL_HEADS)"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas} (REIN_BETAS)")
        return self
