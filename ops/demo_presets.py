"""The demo's defaults per kind of model: the tiny policy, and a Hugging Face model on 2 cores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A model's demo defaults: the flags it sets (``ops.stack_flags``), each overridden by the same flag given on
    the command line; a knob it leaves out keeps the service's own default."""

    mode_why: str
    """Why ``flags["mode"]`` is this model's default: the measurement it comes from, printed when a run starts in it."""
    minutes: float
    """Training wall-time budget, counted from when every service is up (0: steps only)."""
    flags: dict[str, Any]
    """Flag (argparse ``dest``) -> value."""


PRESETS: dict[str, Preset] = {
    # the built-in policy: number guessing for 8 minutes of training (the step cap only bounds a much
    # faster machine). 4 groups of 8 per step at the trainer's lr 1e-3, twice the updates per episode of
    # 8 groups: in process it reached a reward of 0.40 within 48k played episodes on 6 seeds of 6, where
    # 8 groups did on none at lr 1e-3 and on 4 at lr 2e-3 (docs/benchmarks.md, "Learning per episode, in
    # process"); 8 groups in flight, all that the runner's pacing admits with keep_versions 2 x 4 groups;
    # the 16 newest checkpoints kept (a margin of seconds for an engine loading one; all of an 8-minute
    # run's ~1,000 are 1.4 GB); a policy 128 wide instead of 64 (0.4M parameters instead of 0.1M): in
    # process its batch mean was 0.40 after 45k played episodes on 6 seeds (median) where 64 was at 0.32,
    # for ~9 % more CPU per episode in the pipeline (docs/benchmarks.md, "A wider policy")
    "tiny": Preset(
        mode_why="async trained 1.11x sync's samples with signal per second on this policy, more once episodes "
                 "wait on their environment (docs/benchmarks.md, \"Where async pays on the tiny policy\")",
        minutes=8,
        flags={"steps": 2000, "mode": "async", "collectors": 2, "batch_groups": 4, "group_size": 8,
               "concurrent_groups": 8, "keep_checkpoints": 16, "model_width": 128},
    ),
    # a Hugging Face model on 2 cores (docs/models.md): 8 episodes per step, replies of up to 48 tokens,
    # a fine-tuning learning rate with no weight decay (the pretrained weights are the prior), and only
    # the two newest checkpoints kept (an HF step is ~0.5 GB of weights plus ~1 GB of AdamW state)
    "hf": Preset(
        mode_why="on SmolLM2 arithmetic sync reached 0.18 (90 % of the format reward) in 101 s, async in 237 s "
                 "(docs/benchmarks.md, \"Time to reward\"); --mode async for the asynchronous pipeline",
        minutes=20,
        flags={"steps": 500, "mode": "sync", "collectors": 1, "batch_groups": 2, "group_size": 4,
               "concurrent_groups": 4, "task": "arithmetic", "max_tokens": 48, "lr": 2e-5, "weight_decay": 0.0,
               "keep_checkpoints": 2},
    ),
}
