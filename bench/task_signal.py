"""How much signal the arithmetic task gives a model before any training, by the size of its operands.

A group of replies to one prompt trains only if their rewards differ. On the demo's arithmetic task
(operands 0..20) SmolLM2-135M-Instruct mostly learns the format and stalls there (docs/benchmarks.md, "Time
to reward"): few of its replies are right, so past the format its groups rarely carry a signal. This
plays ``--prompts`` of the task's prompts (seeded), ``--samples`` episodes each (a group), for each
``--max-operands``, with the task's own episode (:class:`services.rollout.arithmetic.ArithmeticEpisode`:
the question, one reminder of the format when a reply lacks it, the grade), each reply rendered and ended
as the proxy would (:mod:`bench.sampling`) and sampled at ``--temperature``. Per operand range:

- ``format``: the share of first replies in the format; ``right``: of episodes answered right (either turn);
- ``reward``: the mean episode reward (1 right, 0.2 in the format but wrong, halved after a reminder);
- ``signal``: the share of groups whose rewards differ (they train); ``signal_past_format``: of groups with a
  right answer and another reward beside it (they teach the arithmetic, not only the format).

Usage::

    python bench/task_signal.py --model ~/.cache/rein/models/smollm2-135m-instruct --out bench/task_signal.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sampling import Sampler
from services.rollout.arithmetic import ArithmeticEpisode, ArithmeticTask, parse_answer
from services.rollout.task import Message


def play(sampler: Sampler, payload: dict[str, Any], samples: int, temperature: float,
         max_tokens: int) -> list[tuple[float, bool]]:
    """``samples`` episodes of one prompt, generated together turn by turn: each one's (reward, first reply in the
    format)."""
    episodes = [ArithmeticEpisode() for _ in range(samples)]
    histories: list[list[Message]] = [e.reset(payload) for e in episodes]
    first_kept = [False] * samples
    live = list(range(samples))
    turn = 0
    while live:
        prompts = [sampler.tok.encode_chat(histories[i], add_generation_prompt=True) for i in live]
        replies = sampler.replies(prompts, temperature, max_tokens)
        still = []
        for i, reply in zip(live, replies, strict=True):
            if turn == 0:
                first_kept[i] = parse_answer(reply) is not None
            more = episodes[i].step(reply)
            if more is not None:
                histories[i] = [*histories[i], {"role": "assistant", "content": reply}, *more]
                still.append(i)
        live, turn = still, turn + 1
    return [(e.reward(), kept) for e, kept in zip(episodes, first_kept, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a Hugging Face model directory")
    parser.add_argument("--max-operands", type=int, nargs="+", default=[20, 9, 5])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="episodes per prompt: the demo's group size")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=48, help="the demo's HF budget per reply")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sampler = Sampler.load(args.model)
    rows = []
    header = f"{'operands':>8} {'episodes':>8} {'format':>6} {'right':>6} {'reward':>6} {'signal':>6} {'past fmt':>8}"
    print(header, flush=True)
    for max_operand in args.max_operands:
        torch.manual_seed(args.seed)
        started = time.perf_counter()
        groups = [play(sampler, prompt.payload, args.samples, args.temperature, args.max_tokens)
                  for prompt in itertools.islice(ArithmeticTask(max_operand=max_operand).prompts(args.seed),
                                                 args.prompts)]
        episodes = [e for g in groups for e in g]
        rewards = [[r for r, _ in g] for g in groups]
        rows.append({
            "max_operand": max_operand, "episodes": len(episodes),
            "format": sum(kept for _, kept in episodes) / len(episodes),
            "right": sum(r >= 0.5 for r, _ in episodes) / len(episodes),
            "reward": sum(r for r, _ in episodes) / len(episodes),
            "signal": sum(len(set(g)) > 1 for g in rewards) / len(groups),
            "signal_past_format": sum(max(g) >= 0.5 and len(set(g)) > 1 for g in rewards) / len(groups),
            "seconds": round(time.perf_counter() - started, 1),
        })
        r = rows[-1]
        print(f"{'0..' + str(r['max_operand']):>8} {r['episodes']:>8} {r['format']:>6.0%} {r['right']:>6.0%} "
              f"{r['reward']:>6.3f} {r['signal']:>6.0%} {r['signal_past_format']:>8.0%}", flush=True)
    args.out.write_text(json.dumps({"model": str(args.model), "prompts": args.prompts, "samples": args.samples,
                                    "temperature": args.temperature, "max_tokens": args.max_tokens,
                                    "seed": args.seed, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
