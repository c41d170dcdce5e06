"""The knobs of the trainer's step (loss, optimizer, batch split), declared once.

:class:`~services.trainer.settings.TrainerSettings` takes them as a mixin, so each is a ``REIN_*`` variable
(``REIN_LR``, ``REIN_PPO_CLIP``, ...) documented in docs/settings.md; :class:`~services.trainer.step.PolicyTrainer`
reads them from there, and a test or a bench builds one directly (``LossSettings(lr=1e-2)``).
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from services.trainer.corrections import CorrectionSettings


class LossSettings(CorrectionSettings):
    """The step's settings: the optimizer's, the loss's and the off-policy correction's (its base class)."""

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
    temperature: float = Field(default=1.0, gt=0)
    """Temperature of tokens whose chunks recorded no sampling parameters (records older than that field).
    Every chunk the proxy publishes records its own temperature, top-p and top-k, which the trainer uses."""
    micro_batch_size: int = Field(default=0, ge=0)
    """Samples per forward/backward (gradient accumulation, token-mean kept exact). 0: the whole batch at once."""

    @model_validator(mode="after")
    def _check_loss(self) -> Self:
        if self.is_truncation is not None and self.is_truncation <= 1.0 + self.ppo_clip:
            raise ValueError(
                f"is_truncation ({self.is_truncation}) must exceed 1 + ppo_clip ({1.0 + self.ppo_clip}) "
                "(REIN_IS_TRUNCATION / REIN_PPO_CLIP)"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas} (REIN_BETAS)")
        return self
