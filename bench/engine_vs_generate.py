"""Engine vs ``model.generate`` on prompts of different lengths, and the engine's prefill rules, in one run.

``c`` random-token prompts with lengths spread evenly over ``--min-len..--max-len`` start together;
each generates exactly ``--new-tokens`` tokens, greedy. Side by side, in rounds (variants
interleaved, their order rotated each round):

- ``generate``: Hugging Face ``model.generate`` on one batch statically left-padded to the longest
  prompt (its ``attention_mask`` hides the padding);
- ``engine pad=P``: the engine's :class:`Batcher` stepped in process until every request is done
  (continuous batching, the decoder's KV cache), its prefill grouped by
  :func:`shared.model.decoding.prefill_groups` with ``max_padding=P``: ``0`` prefills one length per
  forward (the engine before batched prefill), ``1`` every prompt in one forward.

tokens/s = generated tokens / wall time, prefill included (the median round); ``x generate`` is the
median over rounds of ``generate``'s wall time over the variant's in the same round, with its range;
``prefill_s`` is the engine's first step (every prompt prefilled, one token each). ``agree`` is the
share of the engine's tokens equal to ``generate``'s (greedy: they differ only where batched float
sums break a near-tie).

Usage::

    python bench/engine_vs_generate.py --out /tmp/rein-bench-vs-generate-tiny.json
    python bench/engine_vs_generate.py --model ~/.cache/rein/models/smollm2-135m-instruct \\
        --out /tmp/rein-bench-vs-generate-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.engine.batcher import Batcher, Weights
from services.engine.sampling import SamplingParams
from shared.model.decoding import MAX_PADDING

VOCAB = 49152
"""SmolLM2's vocabulary, also the tiny Llama's."""


def tiny_llama() -> Any:
    """A random Llama with SmolLM2's vocabulary and a tiny body (fast; per-forward overhead matters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(cfg)
    model.eval()
    return model


def prompts(c: int, low: int, high: int, vocab: int) -> list[list[int]]:
    """``c`` random prompts, lengths evenly spread over ``low..high``, shuffled into no particular order."""
    gen = torch.Generator().manual_seed(0)
    lengths = [round(low + (high - low) * i / max(c - 1, 1)) for i in range(c)]
    order = torch.randperm(c, generator=gen).tolist()
    return [torch.randint(3, vocab, (lengths[i],), generator=gen).tolist() for i in order]


def engine_run(
    model: nn.Module, batch: list[list[int]], n: int, padding: float
) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, first-step seconds, and each request's tokens."""
    batcher = Batcher(Weights(model, "v0", "bench", 0, None), end_id=0, max_batch_size=len(batch),
                      prefill_padding=padding)
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    reqs = [batcher.admit(f"r{i}", p, params) for i, p in enumerate(batch)]
    batcher.step()
    first = time.perf_counter() - start
    while batcher.has_work():
        batcher.step()
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == n for r in reqs)
    return elapsed, first, [r.output_ids for r in reqs]


def generate_run(model: Any, batch: list[list[int]], n: int, pad_id: int) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == n
    return elapsed, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", help="tiny-llama (default) or an HF model directory")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--paddings", type=float, nargs="+", default=[0.0, 0.25, 1.0],
                        help="the engine's prefill max_padding values to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every variant")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model: Any
    if args.model == "tiny-llama":
        name, model = "tiny-llama (vocab 49152)", tiny_llama()
    else:
        from transformers import AutoModelForCausalLM

        path = Path(args.model).expanduser()
        name, model = path.name, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
    pad_id = int(model.config.pad_token_id or 0)
    batch = prompts(args.concurrency, args.min_len, args.max_len, int(model.config.vocab_size))
    n = args.new_tokens
    engine_run(model, batch[:2], 2, MAX_PADDING)  # warm-up (allocator, lazy imports)
    generate_run(model, batch[:2], 2, pad_id)

    variants = ["generate"] + [f"engine pad={p:g}" for p in args.paddings]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    padding = dict(zip(variants[1:], args.paddings, strict=True))
    prefill: dict[str, list[float]] = {v: [] for v in variants[1:]}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotated: no variant always first
            if v == "generate":
                wall, outputs[v] = generate_run(model, batch, n, pad_id)
            else:
                wall, first, outputs[v] = engine_run(model, batch, n, padding[v])
                prefill[v].append(first)
            seconds[v].append(wall)
        print(f"round {r}: " + " ".join(f"{v}={seconds[v][-1]:.2f}s" for v in variants), file=sys.stderr, flush=True)

    tokens = len(batch) * n
    agree = {v: sum(a == b for got, ref in zip(outputs[v], outputs["generate"], strict=True)
                    for a, b in zip(got, ref, strict=True)) / tokens for v in variants[1:]}
    rows = []
    for v in variants:
        wall = statistics.median(seconds[v])
        ratios = [g / w for g, w in zip(seconds["generate"], seconds[v], strict=True)]
        row: dict[str, Any] = {"variant": v, "wall_s": wall, "tok_s": tokens / wall,
                               "over_generate": statistics.median(ratios), "over_generate_range": [min(ratios),
                               max(ratios)], "rounds_s": seconds[v]}
        if v in prefill:
            row |= {"prefill_s": statistics.median(prefill[v]), "agree": agree[v]}
        rows.append(row)
    lengths = sorted(len(p) for p in batch)
    print(f"model={name} threads={args.threads} concurrency={len(batch)} prompts={lengths} new={n} "
          f"rounds={args.rounds}")
    print(f"{'variant':>16} {'tok/s':>8} {'x generate':>10} {'range':>11} {'prefill s':>9} {'agree':>6}")
    for row in rows:
        low, high = row["over_generate_range"]
        extra = f"{row['prefill_s']:>9.2f} {row['agree']:>6.2f}" if "prefill_s" in row else f"{'-':>9} {'-':>6}"
        print(f"{row['variant']:>16} {row['tok_s']:>8.1f} {row['over_generate']:>10.2f} {low:>5.2f}-{high:<5.2f} "
              f"{extra}")
    if args.out is not None:
        result = {"model": name, "threads": args.threads, "concurrency": len(batch), "prompt_lengths": lengths,
                  "new_tokens": n, "rounds": args.rounds, "rows": rows}
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
