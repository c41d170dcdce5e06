"""The physical reference: the demo's training loop in one process, no HTTP, Kafka or Redis.

Same policy (the tiny policy from ``seed``), task (number guessing, prompts from ``seed``),
batch (the ``tiny`` demo preset's groups x episodes per step), sampler (the engine's
:class:`~services.engine.batcher.Batcher`, one-token replies at temperature 1) and update
(:class:`~services.trainer.step.PolicyTrainer` with the trainer's default settings) as
``make demo``, wired with the product's own pure parts instead of its services:

    task episodes -> proxy Transcript (TITO ids) -> engine Batcher -> Chunk records
    -> collector Assembler (CompletedGroup) -> trainer build_samples -> PolicyTrainer.step
    -> the new weights served from the next step

Each step plays its episodes turn by turn (every live episode's call decoded in one
batch, as the engine batches concurrent calls), trains once, and serves the new weights
(synchronous: no staleness). What is left out is exactly the distribution: HTTP, the acked
Kafka writes, the window in Redis, checkpoint files and the weight broadcast.

Learning per episode (docs/benchmarks.md, "Learning per episode, in process"): the batch's shape
(``--batch-groups``, ``--group-size``), any trainer setting (``--set lr=2e-3``), the collector's
treatment of groups without signal (``--no-signal drop``), a fixed policy lag (``--lag 2``) and the
pipeline's asynchronous schedule (``--in-flight 16 --keep-versions 2``: groups in flight, the window,
non-last-version tokens masked; see :class:`~bench.inprocess_loop.Recipe`) are options; the reward is read
against played episodes (``--at-episodes``, ``--target``), over several seeds at once (``--seeds 0 1 2 --jobs 3``).

Prints a table and writes JSON. Usage::

    $(bash deploy/venv.sh --path)/bin/python bench/inprocess.py --steps 80 --out /tmp/rein-bench-inprocess.json
    $(bash deploy/venv.sh --path)/bin/python bench/inprocess.py --seconds 120 --at 10 30 60 120
    $(bash deploy/venv.sh --path)/bin/python bench/inprocess.py --steps 0 --episodes 100000 --seeds 0 1 2 --jobs 3 \
        --at-episodes 18600 48000 100000 --in-flight 16 --no-signal drop

``run()`` is what ``bench/pipeline.py --compare demo`` calls in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.inprocess_loop import Recipe, Reference

DEFAULT_AT = (10.0, 30.0, 60.0, 120.0, 480.0)
"""Wall times (s) at which the reward curve is read by default (480 s: the demo's training budget)."""



def reward_at(rows: Sequence[dict[str, Any]], seconds: float, window: int = 5) -> float | None:
    """Mean reward of the (up to) ``window`` last steps finished by ``seconds`` of wall time."""
    done = [r for r in rows if r["t"] <= seconds and r["reward_mean"] is not None]
    if not done:
        return None
    last = done[-window:]
    return sum(float(r["reward_mean"]) for r in last) / len(last)


def episodes_per_s(rows: Sequence[dict[str, Any]], times: Sequence[float]) -> float | None:
    """Trained episodes of steps 2..N over the wall time from the end of step 1 to the end of step N
    (the pipeline's measure: its start-up and first rollout are excluded)."""
    if len(rows) < 2 or times[-1] <= times[0]:
        return None
    return sum(int(r["trajectories"]) for r in rows[1:]) / (times[-1] - times[0])


def played_reward(rows: Sequence[dict[str, Any]]) -> float | None:
    """Mean reward of the episodes that ended during ``rows`` (every group played: trained, dropped or
    pending), i.e. the policy's reward as the runner sees it."""
    n = sum(int(r["played"]) for r in rows)
    return sum(float(r["played_reward_sum"]) for r in rows) / n if n else None


def last_steps(rows: Sequence[dict[str, Any]], end: int, window: int = 5, episodes: int = 0) -> list[dict[str, Any]]:
    """The ``window`` steps up to ``rows[end]`` (``episodes`` > 0: as many as hold that many played episodes)."""
    if not episodes:
        return list(rows[max(0, end - window + 1) : end + 1])
    first, n = end, 0
    while first > 0 and n + int(rows[first]["played"]) < episodes:
        n += int(rows[first]["played"])
        first -= 1
    return list(rows[first : end + 1])


def reward_at_episodes(rows: Sequence[dict[str, Any]], episodes: int, window: int = 5) -> float | None:
    """:func:`played_reward` of the last ``window`` steps done within ``episodes`` played episodes."""
    done = [i for i, r in enumerate(rows) if r["episodes"] <= episodes]
    if not done:
        return None
    return played_reward(last_steps(rows, done[-1], window))


def episodes_to(rows: Sequence[dict[str, Any]], target: float, window: int = 5, episodes: int = 0) -> int | None:
    """Played episodes when the mean reward of the last ``window`` steps (``episodes`` > 0: of the last steps
    holding that many episodes) first reaches ``target``; None if it never does."""
    for i in range(window - 1 if not episodes else 0, len(rows)):
        span = last_steps(rows, i, window, episodes)
        if episodes and sum(int(r["played"]) for r in span) < episodes:
            continue
        value = played_reward(span)
        if value is not None and value >= target:
            return int(rows[i]["episodes"])
    return None


def run(steps: int = 80, seconds: float = 0.0, seed: int = 0, threads: int = 1,
        at: Sequence[float] = DEFAULT_AT, recipe: Recipe | None = None, episodes: int = 0,
        at_episodes: Sequence[int] = (), target: float = 0.40) -> dict[str, Any]:
    """Train until ``steps``, ``seconds`` or ``episodes`` played (each 0: no bound); one of them must bound it."""
    if steps <= 0 and seconds <= 0 and episodes <= 0:
        raise ValueError("give --steps, --seconds or --episodes")
    ref = Reference(seed=seed, threads=threads, recipe=recipe)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    while ((not steps or len(rows) < steps) and (not seconds or time.perf_counter() - start < seconds)
           and (not episodes or ref.played < episodes)):
        row = ref.step()
        row["t"] = time.perf_counter() - start
        rows.append(row)
    wall = rows[-1]["t"]
    rewards = [r["reward_mean"] for r in rows if r["reward_mean"] is not None]
    k = max(1, min(5, len(rewards) // 4 or 1))
    trainable = sum(int(r["trainable_tokens"]) for r in rows)
    return {
        "seed": seed, "threads": threads, "steps": len(rows), "wall_s": wall,
        "batch": {"groups": ref.batch_groups, "group_size": ref.group_size},
        "recipe": ref.recipe.describe(),
        "episodes": ref.played,
        "trained_episodes": sum(int(r["trajectories"]) for r in rows),
        "episodes_per_s": episodes_per_s(rows, [r["t"] for r in rows]),
        "episodes_per_s_all": sum(int(r["trajectories"]) for r in rows) / wall if wall > 0 else None,
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "reward_window_steps": k,
        "reward_at": {f"{s:g}": reward_at(rows, s) for s in at},
        "reward_at_episodes": {str(n): reward_at_episodes(rows, n) for n in at_episodes},
        "target": target,
        "episodes_to_target": episodes_to(rows, target),
        "episodes_to_target_1280": episodes_to(rows, target, episodes=1280),
        "masked_token_fraction": sum(int(r["masked_tokens"]) for r in rows) / trainable if trainable else 0.0,
        "dropped_stale": sum(int(r["dropped_stale"]) for r in rows),
        "dropped_no_signal": sum(int(r["dropped_no_signal"]) for r in rows),
        "rows": rows,
    }


def _run_seed(kwargs: dict[str, Any]) -> dict[str, Any]:
    return run(**kwargs)


def _spread(values: Sequence[float | None]) -> dict[str, Any]:
    known = sorted(v for v in values if v is not None)
    if len(known) < len(values):  # a seed that never got there: the median is only known if most did
        known_or_inf = sorted(v if v is not None else math.inf for v in values)
        median = statistics.median(known_or_inf)
        return {"median": None if math.isinf(median) else median, "min": known[0] if known else None,
                "max": None, "values": list(values)}
    return {"median": statistics.median(known), "min": known[0], "max": known[-1], "values": list(values)}


def summarise(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and range over seeds of each read-out (a seed that never reached the target counts as +inf)."""
    marks = results[0]["reward_at_episodes"]
    return {
        "seeds": [r["seed"] for r in results],
        "reward_at_episodes": {m: _spread([r["reward_at_episodes"][m] for r in results]) for m in marks},
        "episodes_to_target": _spread([r["episodes_to_target"] for r in results]),
        "episodes_to_target_1280": _spread([r["episodes_to_target_1280"] for r in results]),
        "masked_token_fraction": _spread([r["masked_token_fraction"] for r in results]),
        "dropped_stale": _spread([r["dropped_stale"] for r in results]),
        "dropped_no_signal": _spread([r["dropped_no_signal"] for r in results]),
        "episodes_per_s": _spread([r["episodes_per_s"] for r in results]),
    }


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict[str, Any]) -> str:
    at = "  ".join(f"{s}s {v:.3f}" if v is not None else f"{s}s -" for s, v in result["reward_at"].items())
    lines = [
        f"{'steps':>5} {'wall s':>7} {'episodes/s':>10} {'reward first':>12} {'reward last':>11}",
        f"{result['steps']:>5} {result['wall_s']:>7.1f} {result['episodes_per_s'] or 0:>10.1f} "
        f"{result['reward_first'] or 0:>12.3f} {result['reward_last'] or 0:>11.3f}",
        f"reward at (mean of the last {5} steps done by then): {at}",
    ]
    if result["reward_at_episodes"]:
        marks = "  ".join(f"{n} {_fmt(v)}" for n, v in result["reward_at_episodes"].items())
        lines.append(f"played reward at played episodes (last 5 steps): {marks}")
    lines.append(f"episodes played {result['episodes']} (trained {result['trained_episodes']}), to "
                 f"{result['target']:.2f}: {result['episodes_to_target'] or '-'} (last 5 steps), "
                 f"{result['episodes_to_target_1280'] or '-'} (last 1280 episodes); masked "
                 f"{result['masked_token_fraction']:.3f}, dropped stale {result['dropped_stale']}, "
                 f"no signal {result['dropped_no_signal']}")
    return "\n".join(lines)


def summary_table(summary: dict[str, Any]) -> str:
    def cell(x: dict[str, Any], spec: str = ".3f") -> str:
        return f"{_fmt(x['median'], spec)} [{_fmt(x['min'], spec)}-{_fmt(x['max'], spec)}]"

    marks = "  ".join(f"{n}: {cell(x)}" for n, x in summary["reward_at_episodes"].items())
    return (f"seeds {summary['seeds']}, median [min-max]\n"
            f"played reward at played episodes (last 5 steps): {marks}\n"
            f"episodes to target: {cell(summary['episodes_to_target'], '.0f')} (last 5 steps), "
            f"{cell(summary['episodes_to_target_1280'], '.0f')} (last 1280 episodes)\n"
            f"masked {cell(summary['masked_token_fraction'])}, dropped stale {cell(summary['dropped_stale'], '.0f')}, "
            f"no signal {cell(summary['dropped_no_signal'], '.0f')}, "
            f"episodes/s {cell(summary['episodes_per_s'], '.0f')}")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def recipe_from(args: argparse.Namespace) -> Recipe:
    trainer: list[tuple[str, Any]] = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
        trainer.append((key, _value(value)))
    return Recipe(batch_groups=args.batch_groups, group_size=args.group_size, trainer=tuple(trainer),
                  no_signal=args.no_signal, lag=args.lag, in_flight=args.in_flight, keep_versions=args.keep_versions,
                  jitter=args.jitter, update_delay=args.update_delay)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=80, help="trainer steps (0: until --seconds or --episodes)")
    p.add_argument("--seconds", type=float, default=0.0, help="wall-time bound (0: none)")
    p.add_argument("--episodes", type=int, default=0, help="bound on played episodes (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*", help="several seeds (one run each, summarised); overrides --seed")
    p.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes (each --threads)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the stack gives engine and trainer 1 each)")
    p.add_argument("--at", type=float, nargs="*", default=list(DEFAULT_AT), help="wall times to read the reward at")
    p.add_argument("--at-episodes", type=int, nargs="*", default=[], help="played episodes to read the reward at")
    p.add_argument("--target", type=float, default=0.40, help="reward whose first crossing is reported, in episodes")
    defaults = Recipe()
    p.add_argument("--batch-groups", type=int, default=defaults.batch_groups, help="groups per trainer step")
    p.add_argument("--group-size", type=int, default=defaults.group_size, help="episodes per group")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer setting over its default (TrainerSettings field, JSON value), e.g. lr=2e-3")
    p.add_argument("--no-signal", choices=("keep", "drop"), default=defaults.no_signal,
                   help="groups whose rewards are all equal: fill a batch slot, or are dropped (async collector)")
    p.add_argument("--lag", type=int, default=0, help="sample with weights this many updates old")
    p.add_argument("--in-flight", type=int, default=0,
                   help="0: synchronous; N: the pipeline's schedule with N groups in flight (see Recipe)")
    p.add_argument("--keep-versions", type=int, default=defaults.keep_versions, help="the window with --in-flight")
    p.add_argument("--jitter", type=float, default=defaults.jitter,
                   help="with --in-flight: each turn takes 1 +- this (mean turn times)")
    p.add_argument("--update-delay", type=float, default=defaults.update_delay,
                   help="with --in-flight: from a batch to its weights being served (mean turn times)")
    p.add_argument("--out", type=Path, default=Path("/tmp/rein-bench-inprocess.json"))
    args = p.parse_args(argv)
    recipe = recipe_from(args)
    seeds = args.seeds if args.seeds else [args.seed]
    kwargs = [{"steps": args.steps, "seconds": args.seconds, "seed": seed, "threads": args.threads, "at": args.at,
               "recipe": recipe, "episodes": args.episodes, "at_episodes": args.at_episodes, "target": args.target}
              for seed in seeds]
    if len(seeds) == 1:
        result = run(**kwargs[0])
        print(table(result))
        args.out.write_text(json.dumps(result, indent=2))
    else:
        if args.jobs > 1:
            with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
                results = pool.map(_run_seed, kwargs)
        else:
            results = [run(**kw) for kw in kwargs]
        for result in results:
            print(f"seed {result['seed']}:")
            print(table(result))
        summary = summarise(results)
        print(summary_table(summary))
        args.out.write_text(json.dumps({"recipe": recipe.describe(), "argv": list(argv or sys.argv[1:]),
                                        "summary": summary, "runs": results}, indent=2))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
