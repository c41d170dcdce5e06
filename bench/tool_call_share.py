"""How often a model answers the calculator task's first turn with a tool call, by sampling temperature.

The calculator task (``REIN_TASK=calculator``) needs a call before it can pay more than the format
reward, so a model trains on it only if its replies sometimes hold one. This samples the first reply
to ``--prompts`` of the task's prompts, ``--samples`` times each, rendered exactly as the proxy renders
them (the model's chat template with the task's ``tools``; SmolLM2's template ignores tools, so they
open the system message in its trained form), with Hugging Face ``model.generate`` at each
``--temperatures`` (top-p 1, up to ``--max-tokens`` tokens, stopping at the end of the turn). Each reply
is read by the proxy's parser (:func:`shared.model.tool_calls.parse_reply`):

- ``calls``: the markup parsed into calls (the proxy answers ``tool_calls``);
- ``malformed``: markup that does not parse (answered as content);
- ``right_call``: a ``calculator`` call whose expression evaluates to the answer (one tool round trip
  from the full reward).

``--demonstration`` puts one solved episode before the question (``DEMONSTRATION``: the question,
the assistant's call, the tool's result, the graded answer), to see whether the model copies a call
it was shown.

Usage::

    python bench/tool_call_share.py --model ~/.cache/rein/models/smollm2-135m-instruct \\
        --out bench/tool_call_share.json
    python bench/tool_call_share.py --model ~/.cache/rein/models/smollm2-135m-instruct --demonstration \\
        --temperatures 1.0 0.7 --out bench/tool_call_share_demonstration.json
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
from services.rollout.calculator import INSTRUCTION, CalculatorEpisode, CalculatorTask, evaluate
from shared.model.tool_calls import parse_reply

DEMONSTRATION: list[dict[str, Any]] = [
    {"role": "user", "content": f"Compute 12 * 34. {INSTRUCTION}"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "12 * 34"})}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "408"},
    {"role": "assistant", "content": "12 * 34 = 408.\nAnswer: 408"},
]
"""One solved episode, as the openai client's tool loop would have sent it."""


def right(calls: Any, answer: int) -> bool:
    for call in calls:
        try:
            if call.name == "calculator" and evaluate(str(json.loads(call.arguments).get("expression", ""))) == answer:
                return True
        except (ValueError, AttributeError, TypeError):
            continue
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="replies per prompt and temperature")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.5, 0.3])
    parser.add_argument("--max-tokens", type=int, default=48, help="the demo's HF budget per reply")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--demonstration", action="store_true", help="one solved episode before the question")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sampler = Sampler.load(Path(args.model))
    tok = sampler.tok
    rows = []
    for temperature in args.temperatures:
        torch.manual_seed(args.seed)
        counts = {"replies": 0, "calls": 0, "malformed": 0, "right_call": 0}
        started = time.perf_counter()
        for prompt in itertools.islice(CalculatorTask().prompts(args.seed), args.prompts):
            episode = CalculatorEpisode()
            messages = [*(DEMONSTRATION if args.demonstration else ()), *episode.reset(prompt.payload)]
            ids = tok.encode_chat(messages, add_generation_prompt=True, tools=episode.tools)
            answer = evaluate(f"{prompt.payload['a']} {prompt.payload['op']} {prompt.payload['b']}")
            for text in sampler.replies([ids] * args.samples, temperature, args.max_tokens):
                reply = parse_reply(text, tok.tool_call_format)
                counts["replies"] += 1
                counts["calls"] += bool(reply.calls)
                counts["malformed"] += reply.malformed
                counts["right_call"] += right(reply.calls, int(answer))
        n = counts["replies"]
        rows.append({"temperature": temperature, **counts, "call_share": counts["calls"] / n,
                     "malformed_share": counts["malformed"] / n, "right_call_share": counts["right_call"] / n,
                     "seconds": round(time.perf_counter() - started, 1)})
    print(f"{'temperature':>11} {'replies':>7} {'calls':>6} {'malformed':>9} {'right call':>10}")
    for r in rows:
        print(f"{r['temperature']:>11} {r['replies']:>7} {r['call_share']:>6.0%} {r['malformed_share']:>9.0%} "
              f"{r['right_call_share']:>10.0%}")
    args.out.write_text(json.dumps({"model": args.model, "prompts": args.prompts, "samples": args.samples,
                                    "max_tokens": args.max_tokens, "demonstration": args.demonstration,
                                    "seed": args.seed, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
