"""The gradient a trainer's optimizer stepped with: ``PolicyTrainer.step`` frees the gradients after
its optimizer step, so a test that compares updates records them at the step itself."""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.step import PolicyTrainer


def record_stepped_gradients(trainer: PolicyTrainer) -> list[list[torch.Tensor]]:
    """Wrap ``trainer.optimizer.step`` so every call first copies each parameter's gradient (a zero
    tensor where it has none); returns the list the copies go to, one entry per optimizer step."""
    seen: list[list[torch.Tensor]] = []
    step = trainer.optimizer.step

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append([
            p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in trainer.model.parameters()
        ])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording  # type: ignore[method-assign]
    return seen
