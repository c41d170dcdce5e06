"""Plot ``bench/pipeline.py --compare controls`` results: one point per seed and set-up.

    python bench/plot_controls.py bench/controls.json docs/controls.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def plot(results: list[dict[str, float | str]], out: Path) -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    modes = sorted({str(r["mode"]) for r in results})
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for x, mode in enumerate(modes):
            values = [float(r[key]) for r in results if r["mode"] == mode]
            ax.scatter([x] * len(values), values, color=COLORS.get(mode, "gray"), zorder=3)
            mean = sum(values) / len(values)
            ax.hlines(mean, x - 0.25, x + 0.25, color=COLORS.get(mode, "gray"), linewidth=2)
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
