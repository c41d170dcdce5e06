"""Plot ``bench/pipeline.py --compare controls`` results: one point per seed and set-up.

    python bench/plot_controls.py bench/controls.json docs/controls.png
    python bench/plot_controls.py bench/learning.json docs/learning.png   # adds the reward curves
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = (
    ("logprob_abs_diff_mean", "mean |trainer - rollout logprob|"),
    ("version_gap_mean", "mean version gap"),
    ("reward_last5", "reward, last 5 steps"),
    ("trained_tokens_per_s", "trained tokens / s"),
)
COLORS = {"controls": "tab:blue", "none": "tab:orange"}


def _color(mode: str) -> str:
    """``controls`` / ``learn-controls`` blue, ``none`` / ``learn-none`` orange."""
    return COLORS.get(mode.removeprefix("learn-"), "gray")


def _rolling(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


def plot(results: list[dict[str, Any]], out: Path) -> None:
    curves = all("rewards" in r for r in results)
    n = len(PANELS) + (1 if curves else 0)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.4))
    modes = sorted({str(r["mode"]) for r in results})
    if curves:
        ax = axes[-1]
        for r in results:
            ax.plot(range(1, len(r["rewards"]) + 1), _rolling(r["rewards"], 10), color=_color(str(r["mode"])),
                    alpha=0.8, linewidth=1.2, label=f"{r['mode']} s{r['seed']}")
        ax.set_title("reward per step (10-step mean)", fontsize=10)
        ax.set_xlabel("trainer step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    panels = [("reward_last20", "reward, last 20 steps") if k == "reward_last5" and all("reward_last20" in r for r in
              results) else (k, t) for k, t in PANELS]
    for ax, (key, title) in zip(axes, panels, strict=False):
        for x, mode in enumerate(modes):
            values = [float(r[key]) for r in results if r["mode"] == mode]
            ax.scatter([x] * len(values), values, color=_color(mode), zorder=3)
            mean = sum(values) / len(values)
            ax.hlines(mean, x - 0.25, x + 0.25, color=_color(mode), linewidth=2)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_xlim(-0.6, len(modes) - 0.4)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    seeds = sorted({int(r["seed"]) for r in results})
    steps = sorted({int(r["steps"]) for r in results})
    fig.suptitle(f"staleness control vs none: seeds {seeds}, {steps[0]} steps each (dots: seeds, bars: means)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("results", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args()
    plot(json.loads(args.results.read_text())["results"], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
