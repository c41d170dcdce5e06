"""Engine decode throughput: KV cache vs full recompute, and vs ``model.generate``, in one run.

Drives the engine's :class:`Batcher` in process (no HTTP): ``c`` identical requests
admitted together, greedy, a fixed number of new tokens each (``ignore_eos``), stepped
until all finish. tokens/s = generated tokens / wall time, prefill included. For an HF
model (``--model DIR``) the same prompts also go through plain ``model.generate`` as one
left-padded batch on the same cores, the reference a user would compare against.

Usage::

    python bench/engine_decode.py --out /tmp/rein-bench-decode.json
    python bench/engine_decode.py --model ~/.cache/rein/models/smollm2-135m-instruct \\
        --concurrency 1 8 --new-tokens 64 --out /tmp/rein-bench-decode-hf.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.engine.batcher import Batcher, Weights
from services.engine.sampling import SamplingParams
from shared.model import load_family

QUESTION = [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]


def engine_run(model: torch.nn.Module, prompt: list[int], stop: int, c: int, n: int, cache: bool) -> float:
    batcher = Batcher(Weights(model, "v0", "bench", 0, None), end_id=stop, max_batch_size=max(c, 1),
                      kv_cache=cache)
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    reqs = [batcher.admit(f"r{i}", prompt, params) for i in range(c)]
    while batcher.has_work():
        batcher.step()
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == n for r in reqs)
    return c * n / elapsed


def generate_run(model: Any, prompt: list[int], c: int, n: int, pad_id: int) -> float:
    ids = torch.tensor([prompt] * c)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == n
    return c * n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (default) or an HF directory / .gguf (REIN_MODEL)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 48 (tiny, context 64), 64 (HF)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every row")
    parser.add_argument("--no-recompute", action="store_true", help="skip the no-cache baseline (slow on big models)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    family = load_family(args.model)
    model = family.new_model(0, torch.device("cpu")).eval()
    tok = family.tokenizer
    prompt = tok.encode_chat(QUESTION, add_generation_prompt=True)
    n = args.new_tokens or (48 if family.kind == "tiny" else 64)
    stop = min(tok.stop_ids)
    engine_run(model, prompt, stop, 1, 2, True)  # warm-up (allocator, lazy imports)

    rows: list[dict[str, Any]] = []
    for c in args.concurrency:
        row: dict[str, Any] = {"concurrency": c, "new_tokens": n, "prompt_tokens": len(prompt)}
        row["kv_cache_tok_s"] = engine_run(model, prompt, stop, c, n, True)
        if not args.no_recompute:
            row["recompute_tok_s"] = engine_run(model, prompt, stop, c, n, False)
        if family.kind == "hf":
            row["generate_tok_s"] = generate_run(model, prompt, c, n, tok.pad_id)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    cols = [k for k in ("kv_cache_tok_s", "recompute_tok_s", "generate_tok_s") if k in rows[0]]
    print(f"model={family.name} threads={args.threads} prompt={len(prompt)} tokens new={n} tokens")
    print(f"{'concurrency':>11} " + " ".join(f"{c:>16}" for c in cols))
    for row in rows:
        print(f"{row['concurrency']:>11} " + " ".join(f"{row[c]:>16.1f}" for c in cols))
    if args.out is not None:
        result = {"model": family.name, "threads": args.threads, "rows": rows}
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
