"""The flags that shape a local stack: one set, with one set of defaults, for ``make demo`` and ``rein up``.

Both commands start the same processes (``ops.local.stack``); the flags, each model's defaults
(``ops.demo_presets.PRESETS``, applied where a flag is not given) and the way they become a
:class:`~ops.local.stack.StackConfig` are declared here once, so the two cannot drift apart. Each
command adds only what is its own: the demo its budget and run directory, ``rein up`` its run
directory and an unbounded default step count.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from pathlib import Path
from typing import Any

from ops.args import RegistryChoices, max_preempts_arg
from ops.demo_presets import PRESETS
from ops.local.stack import StackConfig
from services.rollout.tasks import TASKS

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = "smollm2"


def _existing_path(value: str) -> Path:
    path = Path(value)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such checkpoint: {value}")
    return path.resolve()


def add_stack_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of the stack itself (the model, the staleness controls, the batch, the task, the trainer)."""
    p.add_argument(
        "--model", default="tiny", help="tiny (default), smollm2, or a path to a Hugging Face directory or a .gguf file"
    )
    p.add_argument("--keep-versions", type=int, default=2, help="the collector's window (0 = off)")
    p.add_argument("--max-preempts", type=max_preempts_arg, default=2, help="the proxy's span cap (none = no cap)")
    p.add_argument("--pacing", choices=["window", "off"], default="window",
                   help="async mode: start prompts only while the window can still train them (docs/task.md)")
    p.add_argument("--stale-groups", choices=["drop", "withhold"], default="drop",
                   help="the collector's groups with members outside the window: drop whole or withhold those members")
    p.add_argument("--correction", choices=RegistryChoices("services.trainer.corrections", "CORRECTIONS"),
                   default="none", metavar="NAME",
                   help="the trainer's off-policy correction (REIN_OFFPOLICY_CORRECTION): %(choices)s")
    p.add_argument("--nonlast-version-tokens", choices=["mask", "weight"], default="mask",
                   help="the trainer's treatment of a trajectory's tokens from older versions")
    p.add_argument("--collectors", type=int, help="collector replicas (tiny: 2, HF: 1)")
    p.add_argument("--batch-groups", type=int, help="GRPO groups per training batch (tiny: 4, HF: 2)")
    p.add_argument("--group-size", type=int, help="episodes per group (tiny: 8, HF: 4)")
    p.add_argument("--concurrent-groups", type=int, help="groups in flight (tiny: 8, HF: 4)")
    p.add_argument("--task", choices=list(TASKS),
                   help="rollout task (tiny: guess_number; HF: arithmetic, or calculator, which needs a tool call)")
    p.add_argument("--max-tokens", type=int, help="output budget of each reply (tiny: the runner's 1, HF: 48)")
    p.add_argument("--temperature", type=float, help="sampling temperature of every reply (the runner's 1.0)")
    p.add_argument("--agent-command", type=shlex.split,
                   help="a black-box agent run per episode instead of rein's own loop, as a shell would split it; "
                        "{prompt}, {base_url} and {api_key} are replaced (REIN_AGENT_COMMAND, docs/agents.md)")
    p.add_argument("--env-time", type=float, metavar="MEDIAN_S",
                   help="seconds each environment step (an answer, the grade) waits, median: a tool's or a grader's "
                        "time, spent without a core (REIN_ENV_TIME_MEDIAN_S; default none)")
    p.add_argument("--env-time-sigma", type=float, metavar="SIGMA",
                   help="log-normal sigma of that wait (REIN_ENV_TIME_SIGMA; default 0: always the median)")
    p.add_argument("--lr", type=float, help="trainer learning rate (tiny: the trainer's 1e-3, HF: 2e-5)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (tiny: the trainer's 0.01, HF: 0)")
    p.add_argument("--epochs", type=int, help="optimizer steps per batch (REIN_EPOCHS; the trainer's 1)")
    p.add_argument("--init-weights", type=_existing_path, metavar="CHECKPOINT",
                   help="the trainer's step-0 weights from a checkpoint a trainer wrote (a warm start, e.g. "
                        "runs/<id>/weights/v200.pt of a tiny run); default: fresh weights")
    p.add_argument("--model-width", type=int,
                   help="width of the tiny policy's step-0 weights (REIN_MODEL_WIDTH; tiny: 128; HF: its config)")
    p.add_argument("--keep-checkpoints", type=int, help="newest trainer steps kept on disk (0 = all; tiny: 16, HF: 2)")
    p.add_argument("--mode", choices=["async", "sync"],
                   help="async (tiny's default) or sync (HF's: it learned faster on SmolLM2, docs/benchmarks.md)")
    p.add_argument("--no-signal-groups", choices=["drop", "keep"],
                   help="the collectors' groups whose rewards are all equal (default: drop in async mode, keep in "
                        "sync mode; a sync wave tops itself up for each one dropped)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch threads of the trainer and the engine (default 1: a core each; in sync mode one "
                        "phase runs at a time, so each may take every core in turn)")
    p.add_argument("--seed", type=int, default=0)


FLAG_SETTINGS: dict[str, tuple[str, str]] = {
    "steps": ("trainer", "max_steps"),
    "keep_versions": ("collector", "keep_versions"),
    "stale_groups": ("collector", "stale_groups"),
    "no_signal_groups": ("collector", "no_signal_groups"),
    "max_preempts": ("proxy", "max_preempts"),
    "pacing": ("rollout", "pacing"),
    "group_size": ("rollout", "group_size"),
    "concurrent_groups": ("rollout", "max_concurrent_groups"),
    "task": ("rollout", "task"),
    "max_tokens": ("rollout", "max_tokens"),
    "temperature": ("rollout", "temperature"),
    "agent_command": ("rollout", "agent_command"),
    "env_time": ("rollout", "env_time_median_s"),
    "env_time_sigma": ("rollout", "env_time_sigma"),
    "correction": ("trainer", "offpolicy_correction"),
    "nonlast_version_tokens": ("trainer", "nonlast_version_tokens"),
    "lr": ("trainer", "lr"),
    "weight_decay": ("trainer", "weight_decay"),
    "epochs": ("trainer", "epochs"),
    "init_weights": ("trainer", "init_weights"),
    "model_width": ("trainer", "model_width"),
    "keep_checkpoints": ("trainer", "keep_checkpoints"),
}
"""Flag (its argparse ``dest``) -> the service and the setting it gives; a flag left unset (None) leaves the
service's default. The other flags are :class:`StackConfig` fields of the same name (``STACK_FIELDS``)."""

STACK_FIELDS = ("collectors", "batch_groups", "mode", "seed", "torch_threads")


def apply_preset(args: argparse.Namespace) -> None:
    """Fill every flag the command has and the user left unset (None) from the model's preset (the demo's
    ``--minutes`` too)."""
    preset = PRESETS["tiny" if args.model == "tiny" else "hf"]
    for name, value in {**preset.flags, "minutes": preset.minutes}.items():
        if getattr(args, name, 0) is None:
            setattr(args, name, value)


def resolve_model(spec: str) -> str:
    """``REIN_MODEL`` for ``--model``: ``smollm2`` is converted once by ``deploy/smollm2.sh`` (which
    prints its directory); ``tiny`` and paths pass through (the model layer converts a GGUF itself)."""
    if spec != SMOLLM2:
        if spec != "tiny" and not Path(spec).expanduser().exists():
            raise ValueError(f"--model {spec!r}: expected tiny, {SMOLLM2}, or an existing HF directory or .gguf file")
        return spec if spec == "tiny" else str(Path(spec).expanduser().resolve())
    print("preparing SmolLM2-135M-Instruct (deploy/smollm2.sh: download and convert once) ...", flush=True)
    proc = subprocess.run(
        ["bash", str(REPO / "deploy" / "smollm2.sh")], stdout=subprocess.PIPE, text=True, timeout=1800, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ValueError(f"deploy/smollm2.sh failed (exit {proc.returncode}); see its messages above")
    return lines[-1]


def stack_config(args: argparse.Namespace, model: str, run_dir: Path) -> StackConfig:
    """What ``make demo`` or ``rein up`` starts for parsed ``args`` and a resolved ``model`` (``resolve_model``)."""
    hf = model != "tiny"
    services: dict[str, dict[str, Any]] = {}
    for dest, (service, setting) in FLAG_SETTINGS.items():
        value = getattr(args, dest, None)
        if value is not None and not (hf and dest == "model_width"):  # an HF model's width is its config's
            services.setdefault(service, {})[setting] = value
    if hf:  # a stopping HF trainer writes its last checkpoint, ~0.5 GB
        services.setdefault("trainer", {})["stop_timeout_s"] = 110
    return StackConfig(
        run_dir=run_dir,
        model=model,
        services=services,
        **{name: getattr(args, name) for name in STACK_FIELDS if getattr(args, name, None) is not None},
        startup_timeout_s=600.0 if hf else 120.0,
        stop_timeout_s=120.0 if hf else 20.0,
    )


def preset_stack(model: str = "tiny") -> StackConfig:
    """What ``make demo`` starts for ``model`` (``tiny``, or a Hugging Face model's name or path) without flags:
    its preset over the services' defaults (the run directory left unset). For what plays the demo's set-up
    elsewhere (the in-process loop, the benchmarks' predictions)."""
    parser = argparse.ArgumentParser()
    add_stack_flags(parser)
    args = parser.parse_args(["--model", model])
    args.steps = None
    apply_preset(args)
    return stack_config(args, model, Path())
