"""The trainer's step against a plain forward/backward/AdamW of the same batch, on the same thread.

One batch (``--samples`` random-token sequences of ``--min-len``..``--max-len`` tokens, the loss on the
last ``--trained`` share of each, rewards alternating 1/0 in one group, rollout logprobs the model's
own) is stepped by three variants sharing one model and one AdamW optimizer (timing does not depend
on the weights' values, and one copy keeps memory at one model's):

- ``rein``: :meth:`PolicyTrainer.step` as the trainer runs it (collate, PPO-clip loss with its
  statistics, logits only at trained positions, gradient clipping, AdamW);
- ``plain``: what a user would write: ``model(ids).logits`` over the batch, ``log_softmax`` +
  gather, the token-mean policy-gradient loss ``-sum(A * logp * mask) / sum(mask)``, backward,
  the same gradient clipping and AdamW step;
- ``full``: rein's step with ``score_every_position`` (logits and the sampling distribution at
  every position: the step before the trainer scored trained tokens only).

After one warm-up step each, ``--rounds`` rounds run every variant once, in an order rotated each
round; times are wall seconds of one step. Reports each variant's median and range and, per round,
``rein / plain`` and ``full / plain`` (median and range of the per-round ratios). Prints a table and
writes JSON.

Usage::

    python bench/trainer_step.py --out /tmp/rein-bench-trainer-step.json
    python bench/trainer_step.py --tiny-llama --rounds 5 --out /tmp/rein-bench-trainer-step-tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.trainer.loss_settings import LossSettings
from services.trainer.samples import BatchSamples, Sample
from services.trainer.step import PolicyTrainer
from shared.model import load_family
from shared.model.compute import token_logprobs

SMOLLM2 = Path(os.environ.get("REIN_CACHE", "~/.cache/rein")).expanduser() / "models" / "smollm2-135m-instruct"
VOCAB = 49152
VARIANTS = ("rein", "plain", "full")


def tiny_llama() -> nn.Module:
    """A random Llama with SmolLM2's vocabulary and a tiny body: the head is most of its work."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def make_batch(model: nn.Module, samples: int, lengths: tuple[int, int], trained: float, vocab: int,
               device: torch.device) -> BatchSamples:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(samples):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        first = n - max(1, round(trained * n))
        mask = [0] * first + [1] * (n - first)
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids], device=device))[0].cpu()
        out.append(Sample(token_ids=ids, loss_mask=mask, rollout_logprobs=[0.0, *lp.tolist()], trajectory=i,
                          segment_index=0, session_id=f"s{i}"))
    return BatchSamples(samples=out, rewards=[float(i % 2) for i in range(samples)], trajectory_group=[0] * samples,
                        groups=1)


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: BatchSamples, grad_clip: float,
               device: torch.device) -> None:
    """The reference, written plainly: right-padded ids, full logits, token-mean policy gradient, AdamW."""
    width = max(len(s.token_ids) for s in batch.samples)
    ids = torch.zeros(len(batch.samples), width, dtype=torch.long)
    mask = torch.zeros(len(batch.samples), width, dtype=torch.float32)
    for row, s in enumerate(batch.samples):
        ids[row, : len(s.token_ids)] = torch.tensor(s.token_ids)
        mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    rewards = torch.tensor(batch.rewards)
    adv = (rewards - rewards.mean()).to(device)
    ids, mask = ids.to(device), mask[:, 1:].to(device)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    model.eval()


def timed(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def batch_args(doc: str | None, threads_help: str) -> argparse.ArgumentParser:
    """The arguments of the trainer benches: which model, and the batch a step is timed on."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="an HF model directory (default: SmolLM2-135M)")
    parser.add_argument("--tiny-llama", action="store_true", help="a random tiny Llama with a 49k vocabulary instead")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=300)
    parser.add_argument("--max-len", type=int, default=500)
    parser.add_argument("--trained", type=float, default=0.3, help="share of each sample's positions in the loss")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help=threads_help)
    return parser


def load_model(args: argparse.Namespace, device: torch.device) -> tuple[str, nn.Module]:
    """The model ``batch_args`` named, in fp32 on ``device``, and its name."""
    if args.tiny_llama:
        return "tiny-llama (vocab 49152)", tiny_llama().to(device)
    family = load_family(str(args.model))
    return family.name, family.new_model(0, device, dtype=torch.float32)


def main() -> None:
    parser = batch_args(__doc__, "torch threads, the same for every variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name, model = load_model(args, device)
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
    batch = make_batch(model, args.samples, (args.min_len, args.max_len), args.trained, vocab, device)
    hyper = LossSettings(lr=1e-6)
    trainer = PolicyTrainer(model, hyper, device)
    positions = sum(len(s.token_ids) for s in batch.samples)

    def rein(full: bool) -> Callable[[], object]:
        def run() -> object:
            trainer.score_every_position = full
            return trainer.step(batch)
        return run

    runs: dict[str, Callable[[], object]] = {
        "rein": rein(False),
        "plain": lambda: plain_step(model, trainer.optimizer, batch, hyper.grad_clip, device),
        "full": rein(True),
    }
    for variant in VARIANTS:  # warm-up: allocator, lazy imports, AdamW state
        timed(runs[variant], device)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for variant in order:
            times[variant].append(timed(runs[variant], device))
        print(json.dumps({"round": r, **{v: round(times[v][-1], 3) for v in VARIANTS}}), file=sys.stderr, flush=True)

    ratios = {f"{v}_over_plain": summary([a / b for a, b in zip(times[v], times["plain"], strict=True)])
              for v in ("rein", "full")}
    result: dict[str, Any] = {
        "model": name, "device": str(device), "threads": args.threads, "samples": args.samples,
        "positions": positions, "trained_tokens": batch.trained_tokens, "rounds": args.rounds,
        "seconds": {v: summary(times[v]) for v in VARIANTS}, "ratios": ratios, "times": times,
    }
    print(f"model={name} device={device} threads={args.threads} batch={args.samples} samples, {positions} positions, "
          f"{batch.trained_tokens} trained ({batch.trained_tokens / positions:.0%}), {args.rounds} rounds")
    print(f"{'variant':>8} {'median s':>9} {'min s':>7} {'max s':>7} {'/ plain (per round)':>24}")
    for v in VARIANTS:
        s = result["seconds"][v]
        ratio = ratios.get(f"{v}_over_plain")
        text = f"{ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]" if ratio else "1"
        print(f"{v:>8} {s['median']:>9.3f} {s['min']:>7.3f} {s['max']:>7.3f} {text:>24}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
