"""One GRPO/PPO optimizer step on a batch of samples. Torch only, no I/O.

:class:`PolicyTrainer` owns the model and its AdamW optimizer; the loop hands it
a :class:`~services.trainer.samples.BatchSamples` per manifest and gets back the
step's statistics. Samples are right-padded; the causal model makes padding
invisible to earlier positions, and the loss mask keeps it out of the loss.

The model is whatever the model family built (tiny or HF); its weights and optimizer
state stay fp32, and with ``autocast`` set (bf16 on a GPU) only the forward runs in
lower precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from services.trainer.corrections import (
    CORRECTIONS,
    CorrectionStats,
    behaviour_log_ratio,
    corrected_loss,
)
from services.trainer.loss import LossStats, entropy_bonus, grpo_advantages
from services.trainer.loss_settings import LossSettings
from services.trainer.parallel import ALONE, Ranks
from services.trainer.samples import BatchSamples, Sample
from shared.model.compute import token_logprobs, token_logprobs_and_entropy
from shared.model.sampling import NO_TOP_K, SamplingTensors
from shared.schemas import SamplingParams

SkipReason = Literal["no_tokens", "no_signal", "zero_gradient"]
"""Why a batch took no optimizer update: it had no trained token; every trained token's advantage
was exactly 0 (each group's rewards equal, or the spread only on untrained tokens); or the loss's
gradient was exactly 0 (every token clipped). Stepping AdamW anyway would still move the weights
(momentum, weight decay) and cost a version for nothing."""


@dataclass(frozen=True)
class StepStats:
    """One batch's statistics. Those of the loss are None when no forward pass ran (skipped before it)."""

    loss: float | None
    trained_tokens: int
    """Tokens the update trained: 0 for a skipped batch (its loss-masked tokens are ``BatchSamples.trained_tokens``)."""
    train_rollout_logprob_abs_diff: float | None
    clip_fraction: float | None
    truncated_fraction: float | None
    ratio_mean: float | None
    grad_norm: float | None
    advantage_abs_mean: float
    skipped: SkipReason | None = None
    """Set when no optimizer update was taken: weights and optimizer state are exactly as before."""
    same_version_tokens: int = 0
    """Trained tokens sampled by the very weights the trainer held (version gap 0 as the trainer sees it)."""
    train_rollout_logprob_abs_diff_same_version: float | None = None
    """Mean |trainer − rollout logprob| over those tokens (None when there are none): no staleness in it,
    so it measures engine/trainer numerics alone (~1e-7 in fp32; more means they compute differently)."""
    offpolicy_masked_fraction: float = 0.0
    """Share of trained tokens the off-policy correction removed from the loss."""
    offpolicy_clipped_fraction: float = 0.0
    """Share of trained tokens whose importance weight the correction truncated."""
    offpolicy_ess: float | None = None
    """Normalised effective sample size of the weights the loss applied (:attr:`CorrectionStats.ess`)."""
    entropy: float | None = None
    """Mean entropy (nats) of the policy over trained tokens, before the update; scored only with an
    entropy bonus (None without one)."""

    @property
    def updated(self) -> bool:
        return self.skipped is None


def collate(
    samples: list[Sample],
    advantages: torch.Tensor,
    device: torch.device,
    version: str | None = None,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Right-padded tensors: ids ``[B, T]``; mask, rollout logprobs, ``same`` (the token was sampled
    by weights labelled ``version``) and each token's sampling parameters (``temperature``, ``top_k``,
    ``top_p``; ``temperature`` and no filtering where none were recorded) ``[B, T-1]``, aligned to
    ``ids[:, 1:]``."""
    width = max(len(s.token_ids) for s in samples)
    default = SamplingParams(temperature=temperature)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    same = torch.zeros((len(samples), width), dtype=torch.bool)
    rollout = torch.zeros((len(samples), width), dtype=torch.float32)
    temp = torch.full((len(samples), width), temperature, dtype=torch.float32)
    top_k = torch.full((len(samples), width), NO_TOP_K, dtype=torch.long)
    top_p = torch.ones((len(samples), width), dtype=torch.float32)
    for row, s in enumerate(samples):
        n = len(s.token_ids)
        ids[row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        rollout[row, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        if version is not None and s.versions:
            same[row, :n] = torch.tensor([v == version for v in s.versions], dtype=torch.bool)
        if s.sampling:
            params = [p or default for p in s.sampling]
            temp[row, :n] = torch.tensor([p.temperature for p in params], dtype=torch.float32)
            top_k[row, :n] = torch.tensor([p.top_k for p in params], dtype=torch.long)
            top_p[row, :n] = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    adv = advantages[torch.tensor([s.trajectory for s in samples], dtype=torch.long)]
    return {
        "ids": ids.to(device),
        "mask": mask[:, 1:].to(device),
        "same": same[:, 1:].to(device),
        "rollout": rollout[:, 1:].to(device),
        "adv": adv.to(device),
        "temperature": temp[:, 1:].to(device),
        "top_k": top_k[:, 1:].to(device),
        "top_p": top_p[:, 1:].to(device),
    }


class _ChunkLoss(NamedTuple):
    """A micro-batch's collated tensors, logprobs and loss, with what the first pass records of it."""

    tensors: dict[str, torch.Tensor]
    logprobs: torch.Tensor
    loss: torch.Tensor
    stats: LossStats
    corrections: CorrectionStats
    entropy_bonus: float
    """The entropy bonus's value; 0.0 when ``LossSettings.entropy_coef`` is 0 (not scored)."""


class PolicyTrainer:
    """The model, its optimizer and the update rule."""

    def __init__(
        self, model: nn.Module, hyper: LossSettings, device: torch.device, autocast: torch.dtype | None = None,
        ranks: Ranks = ALONE,
    ) -> None:
        self.model = model.to(device)
        self.hyper = hyper
        self.device = device
        self.ranks = ranks
        """The data-parallel group this trainer steps with (``services/trainer/parallel.py``): each rank scores
        its shard of a batch, the gradients and statistics are summed over the ranks, every rank steps alike."""
        self.autocast = autocast
        """Dtype of the forward pass under ``torch.autocast`` (bf16 on a GPU); None: the weights' dtype."""
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=hyper.lr, betas=hyper.betas, weight_decay=hyper.weight_decay
        )
        self.score_every_position = False
        """True scores every position of a sample, not only its trained tokens: the same loss and gradients
        at ``T x V`` logits' cost (the path before ``token_logprobs`` took ``where``), the reference that
        tests and ``bench/trainer_step.py`` hold the default against."""

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def _micro_batches(self, samples: list[Sample]) -> Iterator[list[Sample]]:
        size = self.hyper.micro_batch_size or max(len(samples), 1)  # a rank's shard may be empty
        for start in range(0, len(samples), size):
            yield samples[start : start + size]

    def step(self, batch: BatchSamples, version: str | None = None) -> StepStats:
        """One update on ``batch``, or none when it carries no gradient (:data:`SkipReason`).
        ``version``: the label of the weights the model holds now (before this update), so tokens
        they sampled are scored apart (:attr:`StepStats.same_version_tokens`).

        Every statistic is taken before the update: micro-batches accumulate gradients on the same
        weights and the optimizer steps once, after the last of them; with ``LossSettings.epochs`` > 1 more
        passes follow, each one more step, their statistics not kept. A batch without a trained
        token of non-zero advantage is skipped before the forward pass.
        """
        h = self.hyper
        advantages = grpo_advantages(
            torch.tensor(batch.rewards, dtype=torch.float32),
            torch.tensor(batch.trajectory_group, dtype=torch.long),
            normalize_std=h.normalize_std,
        )
        adv_abs = float(advantages.abs().mean().item()) if advantages.numel() else 0.0
        total = batch.trained_tokens
        if total == 0 or not any(advantages[s.trajectory] != 0 for s in batch.samples if any(s.loss_mask)):
            return StepStats(None, 0, None, None, None, None, None, adv_abs,
                             skipped="no_tokens" if total == 0 else "no_signal")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = diff_sum = clip_sum = trunc_sum = ratio_sum = same_diff_sum = entropy_sum = 0.0
        same_count = 0
        corrected = CorrectionStats()
        mine = batch.samples[self.ranks.rank :: self.ranks.world]  # this rank's shard (all of it alone)
        statistic = self._batch_statistic(mine, advantages, version)
        for chunk in self._micro_batches(mine):
            t, logprobs, loss, stats, correction_stats, bonus = self._chunk_loss(
                chunk, advantages, version, total, statistic
            )
            entropy_sum += bonus
            corrected += correction_stats
            loss.backward()  # type: ignore[no-untyped-call]
            same = t["same"] & t["mask"]
            same_count += int(same.sum().item())
            same_diff_sum += float((logprobs.detach().float() - t["rollout"]).abs()[same].sum().item())
            n = stats.trained_tokens
            loss_sum += float(loss.item())
            diff_sum += stats.train_rollout_logprob_abs_diff * n
            clip_sum += stats.clip_fraction * n
            trunc_sum += stats.truncated_fraction * n
            ratio_sum += stats.ratio_mean * n
        if self.ranks.world > 1:
            self._sum_gradients()
            sums = torch.tensor([loss_sum, diff_sum, clip_sum, trunc_sum, ratio_sum, same_diff_sum, same_count,
                                 corrected.tokens, corrected.masked, corrected.clipped, corrected.weight_sum,
                                 corrected.weight_sq_sum, entropy_sum], dtype=torch.float64)
            self.ranks.all_sum(sums)
            entropy_sum = float(sums[12].item())
            loss_sum, diff_sum, clip_sum, trunc_sum, ratio_sum, same_diff_sum = sums[:6].tolist()
            same_count = int(sums[6].item())
            corrected = CorrectionStats(int(sums[7].item()), int(sums[8].item()), int(sums[9].item()),
                                        float(sums[10].item()), float(sums[11].item()))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), h.grad_clip).item())
        skipped: SkipReason | None = "zero_gradient" if grad_norm == 0.0 else None
        if skipped is None:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the gradients are spent either way; free them
        if skipped is None:
            for _ in range(1, h.epochs):
                self._another_pass(mine, advantages, version, total)
        self.model.eval()
        return StepStats(
            loss=loss_sum,
            trained_tokens=0 if skipped else total,
            train_rollout_logprob_abs_diff=diff_sum / total,
            clip_fraction=clip_sum / total,
            truncated_fraction=trunc_sum / total,
            ratio_mean=ratio_sum / total,
            grad_norm=grad_norm,
            advantage_abs_mean=adv_abs,
            skipped=skipped,
            same_version_tokens=same_count,
            train_rollout_logprob_abs_diff_same_version=same_diff_sum / same_count if same_count else None,
            offpolicy_masked_fraction=corrected.masked_fraction,
            offpolicy_clipped_fraction=corrected.clipped_fraction,
            offpolicy_ess=corrected.ess,
            entropy=entropy_sum if h.entropy_coef > 0 else None,
        )

    def _another_pass(self, mine: list[Sample], advantages: torch.Tensor, version: str | None, total: int) -> None:
        """One more optimizer step on the batch (``LossSettings.epochs``), scored on the weights the last one left:
        the same loss, its batch statistic taken anew, no statistics kept."""
        h = self.hyper
        statistic = self._batch_statistic(mine, advantages, version)
        for chunk in self._micro_batches(mine):
            self._chunk_loss(chunk, advantages, version, total, statistic).loss.backward()  # type: ignore[no-untyped-call]
        if self.ranks.world > 1:
            self._sum_gradients()
        if float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), h.grad_clip).item()) > 0.0:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _chunk_loss(
        self, chunk: list[Sample], advantages: torch.Tensor, version: str | None, total: int,
        statistic: float | None,
    ) -> _ChunkLoss:
        """One micro-batch's loss, normalised by the batch's ``total`` trained tokens, less the entropy bonus
        (``LossSettings.entropy_coef``): the first pass and every further ``epochs`` pass train on the same loss."""
        h = self.hyper
        t, logprobs, entropy = self._score(chunk, advantages, version, with_entropy=h.entropy_coef > 0)
        loss, stats, correction_stats = corrected_loss(
            logprobs, t["rollout"], t["adv"], t["mask"], correction=h,
            clip_eps=h.ppo_clip, is_truncation=h.is_truncation, normalizer=float(total), batch_statistic=statistic,
        )
        bonus = 0.0
        if entropy is not None:
            bonus_t = entropy_bonus(entropy, t["mask"], normalizer=float(total))
            loss = loss - h.entropy_coef * bonus_t
            bonus = float(bonus_t.item())
        return _ChunkLoss(t, logprobs, loss, stats, correction_stats, bonus)

    def _sum_gradients(self) -> None:
        """Sum every parameter's gradient over the ranks in one collective (a rank whose shard was empty
        adds zeros): each shard's loss is normalised by the whole batch's tokens, so the sum is the batch's."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        self.ranks.all_sum(flat)
        start = 0
        for p in params:
            assert p.grad is not None
            n = p.grad.numel()
            p.grad.copy_(flat[start : start + n].view_as(p.grad))
            start += n

    def _score(
        self, samples: list[Sample], advantages: torch.Tensor, version: str | None, *, with_entropy: bool = False
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """The collated tensors of ``samples`` and the model's logprob of each trained token (``t["mask"]``)
        under its own sampling; 0 at every other position, which the loss, the corrections and the
        statistics never read (each takes the mask first). ``with_entropy``: also the entropy of each
        trained token's sampling distribution (else None)."""
        t = collate(samples, advantages, self.device, version, self.hyper.temperature)
        sampling = SamplingTensors(t["temperature"], t["top_k"], t["top_p"])
        where = None if self.score_every_position else t["mask"]
        with torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else nullcontext():
            if with_entropy:
                logprobs, entropy = token_logprobs_and_entropy(self.model, t["ids"], sampling=sampling, where=where)
                return t, logprobs, entropy
            return t, token_logprobs(self.model, t["ids"], sampling=sampling, where=where), None

    def _batch_statistic(self, mine: list[Sample], advantages: torch.Tensor, version: str | None) -> float | None:
        """The correction's batch statistic (M2PO's cutoff) over the whole batch when it is split, into
        micro-batches or over ranks (None otherwise, or for a correction without one: the loss takes it from
        what it sees). Costs one forward pass without gradient per micro-batch; the ranks gather each other's
        log ratios."""
        h = self.hyper
        statistic = CORRECTIONS[h.offpolicy_correction].batch_statistic
        chunks = list(self._micro_batches(mine))
        if statistic is None or (len(chunks) < 2 and self.ranks.world == 1):
            return None
        ratios = [torch.zeros(0, dtype=torch.float64)]
        with torch.no_grad():
            for chunk in chunks:
                t, logprobs, _ = self._score(chunk, advantages, version)
                ratios.append(behaviour_log_ratio(logprobs, t["rollout"], t["mask"])[t["mask"]].to(torch.float64).cpu())
        return statistic(h, torch.cat(self.ranks.all_gather(torch.cat(ratios))))
