"""The physical reference: the demo's training loop in one process, no HTTP, Kafka or Redis.

Same policy (the tiny policy from ``seed``), task (number guessing, prompts from ``seed``),
batch (8 groups x 8 episodes per step, the ``tiny`` demo preset), sampler (the engine's
:class:`~services.engine.batcher.Batcher`, one-token replies at temperature 1) and update
(:class:`~services.trainer.step.PolicyTrainer` with the trainer's default settings) as
``make demo``, wired with the product's own pure parts instead of its services:

    task episodes -> proxy Transcript (TITO ids) -> engine Batcher -> Chunk records
    -> collector Assembler (CompletedGroup) -> trainer build_samples -> PolicyTrainer.step
    -> the new weights served from the next step

Each step plays its 64 episodes turn by turn (every live episode's call decoded in one
batch, as the engine batches concurrent calls), trains once, and serves the new weights
(synchronous: no staleness). What is left out is exactly the distribution: HTTP, the acked
Kafka writes, the window in Redis, checkpoint files and the weight broadcast.

Prints a table and writes JSON. Usage::

    $(bash deploy/venv.sh --path)/bin/python bench/inprocess.py --steps 80 --out /tmp/rein-bench-inprocess.json
    $(bash deploy/venv.sh --path)/bin/python bench/inprocess.py --seconds 120 --at 10 30 60 120

``run()`` is what ``bench/pipeline.py --compare demo`` calls in the same invocation.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from ops.demo_presets import PRESETS
from services.collector.assembly import Assembler, Position
from services.engine.batcher import Batcher, SamplingParams, Weights
from services.proxy.transcript import SegmentState, Transcript
from services.rollout.settings import RolloutSettings
from services.rollout.task import Episode, Message, Prompt
from services.rollout.tasks import TASKS
from services.trainer.loop import hyper_from
from services.trainer.samples import build_samples
from services.trainer.settings import TrainerSettings
from services.trainer.step import PolicyTrainer
from shared.model import load_family
from shared.model.compute import context_window_of
from shared.policy import PolicyConfig
from shared.schemas import Chunk, CompletedGroup, GroupDispatched, SessionFinished
from shared.tokenizer import TOKENIZER

DEFAULT_AT = (10.0, 30.0, 60.0, 120.0, 480.0)
"""Wall times (s) at which the reward curve is read by default (480 s: the demo's training budget)."""


@dataclass
class _Session(Transcript):
    """One episode's transcript, as the proxy keeps it (the mixin's two fields)."""

    segments: list[SegmentState] = field(default_factory=list)
    num_chunks: int = 0


@dataclass
class _Live:
    session_id: str
    group_id: str
    episode: Episode
    messages: list[Message]
    transcript: _Session = field(default_factory=_Session)
    turn: int = 0


class Reference:
    """The demo's loop in one process; :meth:`step` plays one batch of groups and trains on it."""

    def __init__(self, seed: int = 0, threads: int = 1) -> None:
        preset = PRESETS["tiny"]
        torch.set_num_threads(threads)
        self.trainer_settings = TrainerSettings()
        self.rollout_settings = RolloutSettings()
        s = self.trainer_settings
        self.batch_groups, self.group_size = preset.batch_groups, preset.group_size
        self.family = load_family("tiny", tiny_config=PolicyConfig(
            vocab_size=TOKENIZER.vocab_size, context=s.model_context, width=s.model_width,
            layers=s.model_layers, heads=s.model_heads))
        self.tokenizer = self.family.tokenizer
        device = torch.device("cpu")
        model = self.family.new_model(seed, device, dtype=torch.float32)
        self.trainer = PolicyTrainer(model, hyper_from(s), device)
        self.context = context_window_of(self.family, model)
        self.batcher = Batcher(self._serve(0), end_id=self.tokenizer.stop_ids, pad_id=self.tokenizer.pad_id,
                               seed=seed, device=device)
        self.task = TASKS[preset.task]()
        self.prompts: Iterator[Prompt] = self.task.prompts(seed)
        self.assembler = Assembler()
        self.params = SamplingParams(max_new_tokens=preset.max_tokens or self.rollout_settings.max_tokens,
                                     temperature=self.rollout_settings.temperature)
        self.step_no = 0
        self._offsets = itertools.count()
        self._ids = itertools.count()

    def _serve(self, step: int) -> Weights:
        """The trainer's weights as the engine would load them (a copy, so training never touches them)."""
        model = copy.deepcopy(self.trainer.model).eval()
        for p in model.parameters():
            p.grad = None
        return Weights(model=model, version=f"v{step}", digest="", step=step, model_path=None)

    def _add(self, record: Chunk | GroupDispatched | SessionFinished) -> CompletedGroup | None:
        return self.assembler.add(Position("inprocess", 0, next(self._offsets)), record)

    def rollout(self) -> list[CompletedGroup]:
        """Play ``batch_groups`` groups of ``group_size`` episodes; their records through the collector's assembler."""
        live: list[_Live] = []
        for _ in range(self.batch_groups):
            prompt = next(self.prompts)
            group_id = f"g{next(self._ids)}"
            sessions = [f"{group_id}-s{i}" for i in range(self.group_size)]
            self._add(GroupDispatched(group_id=group_id, prompt_id=prompt.prompt_id, session_ids=sessions,
                                      prompt=prompt.payload))
            for sid in sessions:
                episode = self.task.episode()
                live.append(_Live(sid, group_id, episode, episode.reset(dict(prompt.payload))))
        done: list[CompletedGroup] = []
        while live:
            calls = []
            for ep in live:
                plan = ep.transcript.plan(ep.messages, self.tokenizer)
                request = self.batcher.admit(f"{ep.session_id}-t{ep.turn}", plan.prompt_ids, self.params)
                calls.append((ep, plan, request))
            while self.batcher.has_work():
                self.batcher.step()
            still: list[_Live] = []
            for ep, plan, req in calls:
                assert req.finish_type is not None
                seq = ep.transcript.record_chunk(plan, plan.context_ids, req.output_ids, req.versions)
                self._add(Chunk(session_id=ep.session_id, group_id=ep.group_id, seq=seq,
                                segment_index=plan.segment_index, chunk_index=0, context_ids=list(plan.context_ids),
                                output_ids=req.output_ids, logprobs=req.logprobs, version=req.weight_version,
                                finish_reason=req.finish_type, rid=req.rid))
                ep.turn += 1
                text = self.tokenizer.decode(req.output_ids)
                ep.messages.append({"role": "assistant", "content": text})
                feedback = ep.episode.step(text)
                if feedback is not None:
                    ep.messages.extend(feedback)
                    still.append(ep)
                    continue
                group = self._add(SessionFinished(session_id=ep.session_id, group_id=ep.group_id,
                                                  reward=ep.episode.reward(), status=ep.episode.status,
                                                  num_chunks=ep.transcript.num_chunks))
                if group is not None:
                    self.assembler.release(group.group_id)
                    done.append(group)
            live = still
        self.assembler.take_done()
        return done

    def step(self) -> dict[str, Any]:
        """One batch: rollout, then the trainer's step; the next rollout samples from the updated weights
        (unchanged after a batch the trainer skipped)."""
        groups = self.rollout()
        batch = build_samples(groups, mask_nonlast_version=self.trainer_settings.nonlast_version_tokens == "mask",
                              max_tokens=self.context)
        stats = self.trainer.step(batch)
        if stats.updated:  # as the trainer does: a batch without gradient leaves weights and version alone
            self.step_no += 1
            self.batcher.swap_weights(self._serve(self.step_no))
        rewards = batch.rewards
        return {"step": self.step_no, "trajectories": len(rewards),
                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                "trained_tokens": stats.trained_tokens, "loss": stats.loss, "skipped": stats.skipped}


def reward_at(rows: Sequence[dict[str, Any]], seconds: float, window: int = 5) -> float | None:
    """Mean reward of the (up to) ``window`` last steps finished by ``seconds`` of wall time."""
    done = [r for r in rows if r["t"] <= seconds and r["reward_mean"] is not None]
    if not done:
        return None
    last = done[-window:]
    return sum(r["reward_mean"] for r in last) / len(last)


def episodes_per_s(rows: Sequence[dict[str, Any]], times: Sequence[float]) -> float | None:
    """Trained episodes of steps 2..N over the wall time from the end of step 1 to the end of step N
    (the pipeline's measure: its start-up and first rollout are excluded)."""
    if len(rows) < 2 or times[-1] <= times[0]:
        return None
    return sum(int(r["trajectories"]) for r in rows[1:]) / (times[-1] - times[0])


def run(steps: int = 80, seconds: float = 0.0, seed: int = 0, threads: int = 1,
        at: Sequence[float] = DEFAULT_AT) -> dict[str, Any]:
    """Train until ``steps`` (0: no bound) or ``seconds`` (0: no bound); one of them must bound it."""
    if steps <= 0 and seconds <= 0:
        raise ValueError("give --steps or --seconds")
    ref = Reference(seed=seed, threads=threads)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    while (not steps or len(rows) < steps) and (not seconds or time.perf_counter() - start < seconds):
        row = ref.step()
        row["t"] = time.perf_counter() - start
        rows.append(row)
    wall = rows[-1]["t"]
    rewards = [r["reward_mean"] for r in rows if r["reward_mean"] is not None]
    k = max(1, min(5, len(rewards) // 4 or 1))
    return {
        "seed": seed, "threads": threads, "steps": len(rows), "wall_s": wall,
        "batch": {"groups": ref.batch_groups, "group_size": ref.group_size},
        "episodes": sum(int(r["trajectories"]) for r in rows),
        "episodes_per_s": episodes_per_s(rows, [r["t"] for r in rows]),
        "episodes_per_s_all": sum(int(r["trajectories"]) for r in rows) / wall if wall > 0 else None,
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "reward_window_steps": k,
        "reward_at": {f"{s:g}": reward_at(rows, s) for s in at},
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    at = "  ".join(f"{s}s {v:.3f}" if v is not None else f"{s}s -" for s, v in result["reward_at"].items())
    return (
        f"{'steps':>5} {'wall s':>7} {'episodes/s':>10} {'reward first':>12} {'reward last':>11}\n"
        f"{result['steps']:>5} {result['wall_s']:>7.1f} {result['episodes_per_s'] or 0:>10.1f} "
        f"{result['reward_first'] or 0:>12.3f} {result['reward_last'] or 0:>11.3f}\n"
        f"reward at (mean of the last {5} steps done by then): {at}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=80, help="trainer steps (0: until --seconds)")
    p.add_argument("--seconds", type=float, default=0.0, help="wall-time bound (0: steps only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the stack gives engine and trainer 1 each)")
    p.add_argument("--at", type=float, nargs="*", default=list(DEFAULT_AT), help="wall times to read the reward at")
    p.add_argument("--out", type=Path, default=Path("/tmp/rein-bench-inprocess.json"))
    args = p.parse_args(argv)
    result = run(args.steps, args.seconds, args.seed, args.threads, args.at)
    print(table(result))
    args.out.write_text(json.dumps(result, indent=2))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
