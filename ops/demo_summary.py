"""What ``make demo`` says about a run: one progress line per trainer line while it runs, and at the end
``summary.json`` (steps, reward and whether it learned by docs/task.md's rule, staleness and waste,
seconds per step, the settings) and ``plot.png`` in the run directory."""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from typing import Any

from ops.demo_metrics import EngineUsage
from ops.learned import judge
from ops.local.stack import StackConfig
from ops.report import optimizer_steps, plot_run, waste
from ops.stack_flags import FLAG_SETTINGS, STACK_FIELDS


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def timing(rows: list[dict[str, Any]], usage: EngineUsage | None, train_wall_s: float | None) -> dict[str, Any]:
    """Seconds per step, split: ``train_s`` is the trainer's forward/backward/optimizer time
    (``step_time_s`` less the fetch), ``step_wall_s`` the interval between steps, and
    ``generation_s`` the time the engine had a request decoding, per step (async mode overlaps
    the two, so they may add up to more than the interval). ``idle`` is each role's share of the
    training wall time without work: the trainer's outside its steps, the engine's with nothing to
    decode (sampled), which is what a synchronous wave waiting on its slowest episode wastes."""
    ts = [float(r["ts"]) for r in rows if r.get("ts") is not None]
    intervals = [b - a for a, b in itertools.pairwise(ts)]
    train = [
        float(r["step_time_s"]) - float(r.get("fetch_time_s") or 0.0) for r in rows if r.get("step_time_s") is not None
    ]
    out: dict[str, Any] = {"step_wall_s": _mean(intervals), "train_s": _mean(train)}
    busy = usage.busy_fraction if usage is not None else None
    if busy is not None and train_wall_s and rows:
        out["generation_s"] = busy * train_wall_s / len(rows)
        out["engine_busy_fraction"] = busy
        out["generated_tokens"] = usage.tokens if usage is not None else None
        out["generated_tokens_per_s"] = usage.tokens / train_wall_s if usage is not None else None
    if train_wall_s:
        idle = {"trainer": max(0.0, 1.0 - sum(train) / train_wall_s)}
        if busy is not None:
            idle["engine"] = 1.0 - busy
        out["idle"] = {k: round(v, 3) for k, v in idle.items()}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def settings_of(config: StackConfig) -> dict[str, Any]:
    """What the run's services ran with, by the flag of each (``ops.stack_flags``), defaults included; a path as
    text."""
    values = {dest: config.setting(*where) for dest, where in FLAG_SETTINGS.items()}
    values |= {name: getattr(config, name) for name in STACK_FIELDS}
    if values["init_weights"] is not None:
        values["init_weights"] = str(values["init_weights"])
    if config.model != "tiny":
        values["model_width"] = None  # an HF model's width is its config's
    return values


def summarize(
    rows: list[dict[str, Any]],
    rejections: int,
    wall_s: float,
    config: StackConfig,
    *,
    stopped_by: str = "steps",
    usage: EngineUsage | None = None,
    train_wall_s: float | None = None,
    train_started_ts: float | None = None,
    tool_calls: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rewards = [float(r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]  # skipped batches too
    task = config.setting("rollout", "task")
    verdict = judge(task, rewards)
    steps = optimizer_steps(rows)
    skipped = Counter(str(r["skipped"]) for r in rows if r.get("skipped"))
    gaps = [float(r["version_gap_mean"]) for r in rows if r.get("version_gap_mean") is not None]
    diffs = [
        float(r["train_rollout_logprob_abs_diff"]) for r in rows if r.get("train_rollout_logprob_abs_diff") is not None
    ]
    same = [float(r["train_rollout_logprob_abs_diff_same_version"]) for r in rows
            if r.get("train_rollout_logprob_abs_diff_same_version") is not None]
    masked = [float(r["masked_token_fraction"]) for r in rows if r.get("masked_token_fraction") is not None]
    return {
        "model": config.model,
        "task": task,
        "steps": len(steps),
        "batches": len(rows),
        "skipped_steps": dict(sorted(skipped.items())),  # batches consumed without an update, by reason
        "stopped_by": stopped_by,
        "wall_s": round(wall_s, 1),
        "train_wall_s": None if train_wall_s is None else round(train_wall_s, 1),
        "train_started_ts": train_started_ts,  # epoch seconds when every service was up (rows' ``ts`` clock)
        "seconds_per_step": timing(steps, usage, train_wall_s),
        "reward_start": verdict.start,
        "reward_end": verdict.end,
        "reward_window_steps": verdict.window,
        "learned": verdict.learned,  # docs/task.md's bar for the task (ops/learned.py), None if it has none
        "version_gap_mean": _mean(gaps),
        "version_gap_max": max(
            (int(r["version_gap_max"]) for r in rows if r.get("version_gap_max") is not None), default=None
        ),
        "train_rollout_logprob_abs_diff_mean": _mean(diffs),
        # tokens the trainer's own weights sampled: engine/trainer numerics alone (~1e-7 in fp32)
        "train_rollout_logprob_abs_diff_same_version_max": max(same, default=None),
        "masked_token_fraction_mean": _mean(masked),
        "dropped_groups": rows[-1].get("drops_cumulative") if rows else None,
        "waste": waste(rows),  # generated tokens never trained, by cause (ops.report.waste)
        "rejected_sessions": rejections,
        "tool_calls": tool_calls,  # replies with call markup, parsed or malformed (the proxy's counter); None: none
        "settings": settings_of(config),
    }


def progress_line(
    row: dict[str, Any], total: int, rejections: int, started: float, budget: tuple[float, float] | None = None
) -> str:
    """One line per trainer line (a step, or a batch skipped without one: it says so); the bar and the
    count follow the steps, or the time budget ``(since, seconds)`` if that ends first."""
    step = int(row.get("step", 0))
    width = 24
    fraction = step / max(total, 1)
    where = f"step {step:>3}/{total}"
    if budget is not None and budget[1] > 0:
        elapsed = time.monotonic() - budget[0]
        if elapsed / budget[1] > fraction:
            fraction = elapsed / budget[1]
            where = f"step {step:>3}  {elapsed / 60:.1f}/{budget[1] / 60:.3g} min"
    done = min(width, int(width * fraction))
    gap = row.get("version_gap_mean")
    reward = row.get("reward_mean")
    return (
        f"[{'#' * done}{'.' * (width - done)}] {where}"
        f"  reward {reward if reward is None else f'{reward:.3f}'}"
        f"  gap {gap if gap is None else f'{gap:.2f}'}"
        f"  drops {row.get('drops_cumulative', 0)}  rejections {rejections}"
        f"  {time.monotonic() - started:6.0f}s"
        + (f"  skipped ({row['skipped']})" if row.get("skipped") else "")
    )


def write_outputs(config: StackConfig, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """``summary.json`` and ``plot.png`` in the run directory, and the summary's main keys on stdout."""
    (config.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    png = plot_run(rows, config.run_dir / "plot.png", title=f"rein demo {config.run_dir.name}")
    keys = [
        "steps",
        "skipped_steps",
        "reward_start",
        "reward_end",
        "learned",
        "version_gap_mean",
        "dropped_groups",
        "rejected_sessions",
        "wall_s",
    ]
    if config.model != "tiny":
        keys += ["stopped_by", "seconds_per_step"]
    print(json.dumps({k: summary[k] for k in keys}))
    print(f"summary: {config.run_dir / 'summary.json'}\nplot:    {png}")
