"""Plots of a training run's metrics: the logic behind ``rein report`` (the demo reuses it).

Input is the trainer's ``metrics.jsonl``: one JSON object per manifest it consumed, an
optimizer step or a batch skipped without one (``skipped`` says why; its ``step`` is the
previous step's, so it plots at that step). Every field is optional; a panel is drawn only
for the metrics some line has, and unknown fields are ignored, so older and newer runs both
render. Panels, in order:

- reward: ``reward_mean``
- version gap: ``version_gap_min`` / ``version_gap_max`` / ``version_gap_mean``
- drops: ``drops_in_batch`` and ``drops_cumulative`` (second axis), ``rejected_sessions``
- untrained tokens: ``untrained_<cause>_cumulative`` for the window's causes (``window``,
  ``no_signal``, ``failed``, ``withheld``) and the running sum of ``version_masked_tokens`` (masked)
- logprob diff: ``train_rollout_logprob_abs_diff``
- masked tokens: ``masked_token_fraction``
- loss: ``loss``
- tool calls: ``tool_call_share`` / ``malformed_call_share`` (a tool task's demo puts the proxy's counts
  on its lines: ``ops.demo_metrics.ToolCallSeries``)

The x axis is ``step`` (the line number when a line has none).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shared.staleness import UNTRAINED_CAUSE_NAMES


@dataclass(frozen=True)
class Panel:
    """One subplot: a title, the series on the left axis (some summed) and those on a right axis."""

    title: str
    left: tuple[str, ...]
    right: tuple[str, ...] = ()
    ylabel: str = ""
    summed: tuple[str, ...] = ()
    """Per-line series drawn on the left axis as their running sum."""


PANELS: tuple[Panel, ...] = (
    Panel("reward", ("reward_mean",), ylabel="mean reward"),
    Panel("version gap", ("version_gap_min", "version_gap_mean", "version_gap_max"), ylabel="versions"),
    Panel("drops", ("drops_in_batch", "rejected_sessions"), ("drops_cumulative",), ylabel="per batch"),
    Panel("untrained tokens", tuple(f"untrained_{c}_cumulative" for c in UNTRAINED_CAUSE_NAMES),
          ylabel="cumulative tokens", summed=("version_masked_tokens",)),
    Panel("train vs rollout logprob", ("train_rollout_logprob_abs_diff",), ylabel="mean |diff|"),
    Panel("masked tokens", ("masked_token_fraction",), ylabel="fraction"),
    Panel("loss", ("loss",), ylabel="loss"),
    Panel("tool calls", ("tool_call_share", "malformed_call_share"), ylabel="share of replies"),
)


@dataclass
class Loaded:
    """Rows of a metrics file plus how many lines were skipped as malformed."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0


def read_metrics(path: Path) -> Loaded:
    """Parse ``metrics.jsonl``; blank lines are ignored, non-object or non-JSON lines counted."""
    out = Loaded()
    with path.open(encoding="utf-8", errors="replace") as handle:
        _parse(handle, out)
    return out


def _parse(lines: Iterable[str], out: Loaded) -> None:
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            out.malformed += 1
            continue
        if not isinstance(row, dict):
            out.malformed += 1
            continue
        out.rows.append(row)


class MetricsTail:
    """The rows of a ``metrics.jsonl`` that a live trainer appends to, read as it grows: each :meth:`read`
    parses only the complete lines added since the last (the demo polls twice a second, and reading the
    whole file each time cost 17 ms at 1100 rows). The trainer only appends, or cuts a torn last line,
    which is never read; a file that shrank below what was read is read again from its start."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._read = Loaded()
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        """Every row so far (none while the file does not exist)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return self._read.rows
        if size < self._offset:
            self._read, self._offset = Loaded(), 0
        if size > self._offset:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read(size - self._offset)
            complete = data[: data.rfind(b"\n") + 1]
            self._offset += len(complete)
            _parse(complete.decode("utf-8", errors="replace").splitlines(), self._read)
        return self._read.rows


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (malformed lines skipped; :func:`read_metrics` counts them)."""
    return read_metrics(Path(path)).rows


def rows_so_far(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` a live trainer is still writing: none yet if it does not exist."""
    return load_metrics(path) if Path(path).exists() else []


def optimizer_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that took an optimizer step (not a batch skipped for lack of gradient)."""
    return [r for r in rows if not r.get("skipped")]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def series(metrics: list[dict[str, Any]], name: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric over the rows that have a finite number for it."""
    xs: list[float] = []
    ys: list[float] = []
    for i, row in enumerate(metrics):
        y = _number(row.get(name))
        if y is None:
            continue
        step = _number(row.get("step"))
        xs.append(step if step is not None else float(i))
        ys.append(y)
    return xs, ys


def present_panels(metrics: list[dict[str, Any]]) -> list[Panel]:
    """The panels with at least one point."""
    return [p for p in PANELS if any(series(metrics, n)[0] for n in (*p.left, *p.right, *p.summed))]


def _draw(ax: Axes, metrics: list[dict[str, Any]], panel: Panel) -> None:
    handles = []
    for name in panel.left:
        xs, ys = series(metrics, name)
        if xs:
            handles += ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
    for name in panel.summed:
        xs, ys = series(metrics, name)
        if xs:
            handles += ax.plot(xs, list(itertools.accumulate(ys)), label=f"{name} (summed)")
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    right = [(n, *series(metrics, n)) for n in panel.right]
    right = [r for r in right if r[1]]
    if right:
        twin = ax.twinx()
        for name, xs, ys in right:
            handles += twin.plot(xs, ys, linestyle="--", color="black", label=name)
        twin.set_ylabel("cumulative")
    if handles:
        ax.legend(handles=handles, labels=[h.get_label() for h in handles], fontsize="small", loc="best")


def waste(metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Generated tokens never trained, as of the last line: by cause, in all, and their share of generated.

    The window's causes come from the last line's cumulative tally; ``masked`` is the sum of every
    line's ``version_masked_tokens`` (one line per manifest); ``skipped`` the trainable tokens the
    version mask left in batches the trainer skipped without an update (no gradient: a sync wave of
    groups without signal). None when no line has the tally.
    """
    tallied = [r for r in metrics if _number(r.get("generated_tokens_cumulative")) is not None]
    if not tallied:
        return None
    last = tallied[-1]
    tokens = {c: int(_number(last.get(f"untrained_{c}_cumulative")) or 0) for c in UNTRAINED_CAUSE_NAMES}
    tokens["masked"] = int(sum(_number(r.get("version_masked_tokens")) or 0 for r in metrics))
    tokens["skipped"] = int(sum(
        (_number(r.get("trainable_tokens")) or 0) - (_number(r.get("version_masked_tokens")) or 0)
        for r in metrics if r.get("skipped")
    ))
    generated = int(last["generated_tokens_cumulative"])
    untrained = sum(tokens.values())
    return {
        "tokens": tokens,
        "untrained": untrained,
        "generated": generated,
        "share": round(untrained / generated, 4) if generated else None,
    }


def plot_run(metrics: list[dict[str, Any]], out_png: Path, title: str) -> Path:
    """Write one PNG with a subplot per metric group present in ``metrics``; returns its path.

    A run with no plottable metric still gets a PNG (a single panel saying so), so
    callers always have a file to point at.
    """
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    panels = present_panels(metrics)
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / cols))
    # A Figure with its own Agg canvas, not pyplot: no process-global figure state, safe in threads.
    fig = Figure(figsize=(6.5 * cols, 3.2 * rows + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    flat = [ax for row in axes for ax in row]
    if not panels:
        flat[0].text(0.5, 0.5, "no plottable metrics", ha="center", va="center", transform=flat[0].transAxes)
        flat[0].set_axis_off()
    for ax, panel in zip(flat, panels, strict=False):
        _draw(ax, metrics, panel)
        ax.set_xlabel("step")
    for ax in flat[len(panels) or 1 :]:
        ax.set_axis_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    return out_png
