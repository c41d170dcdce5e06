"""The trainer's step on one rank against two data-parallel ranks (``services/trainer/parallel.py``), same batch.

One batch (``bench/trainer_step.py``'s: ``--samples`` random-token sequences of ``--min-len``..``--max-len``
tokens, the loss on the last ``--trained`` share) is stepped by :meth:`PolicyTrainer.step`

- ``1 rank``: one process with ``--threads`` torch threads (the whole machine);
- ``2 ranks``: two ``gloo`` processes on loopback with ``--threads / 2`` threads each, each scoring
  half the samples, gradients summed in one all-reduce.

After one warm-up step, ``--rounds`` steps are timed (wall seconds, rank 0's, between barriers for the
ranks); the table gives the median and range and ``x 1 rank`` (the median over the median). Both
variants run in this invocation, one after the other. Prints a table and writes JSON.

Usage::

    python bench/trainer_ranks.py --out bench/trainer_ranks.json                  # SmolLM2-135M
    python bench/trainer_ranks.py --tiny-llama --rounds 3 --out /tmp/rein-bench-ranks-tiny.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trainer_step import VOCAB, batch_args, load_model, make_batch
from ops.local.ports import free_port
from services.trainer.loss_settings import LossSettings
from services.trainer.parallel import ALONE, Ranks, TorchRanks
from services.trainer.step import PolicyTrainer


def steps(args: argparse.Namespace, ranks: Ranks) -> list[float]:
    """Seconds of each timed step (after one warm-up) on these ranks."""
    _, model = load_model(args, torch.device("cpu"))
    batch = make_batch(model, args.samples, (args.min_len, args.max_len), args.trained, VOCAB, torch.device("cpu"))
    trainer = PolicyTrainer(model, LossSettings(lr=1e-6), torch.device("cpu"), ranks=ranks)
    out = []
    for i in range(args.rounds + 1):
        ranks.barrier()
        started = time.perf_counter()
        stats = trainer.step(batch)
        ranks.barrier()
        assert stats.skipped is None, stats.skipped
        if i:
            out.append(time.perf_counter() - started)
    return out


def _rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(max(1, args.threads // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(minutes=30))
    try:
        times = steps(args, TorchRanks())
        if rank == 0:
            queue.put(times)
    finally:
        dist.destroy_process_group()


def two_ranks(args: argparse.Namespace) -> list[float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        times: list[float] = queue.get(timeout=3600)
    finally:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return times


def main() -> None:
    parser = batch_args(__doc__, "torch threads in all: one rank's, split over two")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    one = steps(args, ALONE)
    two = two_ranks(args)
    rows = [{"variant": name, "threads_per_rank": threads, "step_s": statistics.median(times),
             "min_s": min(times), "max_s": max(times), "x_one_rank": statistics.median(times) / statistics.median(one)}
            for name, threads, times in (("1 rank", args.threads, one), ("2 ranks", max(1, args.threads // 2), two))]
    print(f"{'variant':<8} {'threads/rank':>12} {'step s (median)':>16} {'range':>16} {'x 1 rank':>9}")
    for r in rows:
        print(f"{r['variant']:<8} {r['threads_per_rank']:>12} {r['step_s']:>16.3f} "
              f"{r['min_s']:>7.3f}-{r['max_s']:<8.3f} {r['x_one_rank']:>9.2f}")
    model = "tiny-llama (vocab 49152)" if args.tiny_llama else str(args.model)
    args.out.write_text(json.dumps({"model": model, "samples": args.samples, "lengths": [args.min_len, args.max_len],
                                    "threads": args.threads, "rounds": args.rounds, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
