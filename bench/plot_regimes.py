"""Plot where asynchrony pays: ``bench/async_regimes.py``'s grid as one figure (the README's headline).

x: the environment step's median wait, as a multiple of the per-turn generation time g; y: async ÷ sync
in samples with signal per second (left) and in trained samples per second (right); one line per sigma,
measured solid, predicted dashed; 1 is break-even. A cell the grid has not measured is left out of the
solid line, and one whose runs made fewer than ``MIN_STEPS`` steps in an arm (censored: too few to
measure a step time) is an open marker off the line::

    python bench/plot_regimes.py bench/async_regimes.json docs/async_regimes.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {0.0: "tab:blue", 1.0: "tab:orange", 2.0: "tab:red"}
MIN_STEPS = 3
PANELS = (("signal_speedup", "async ÷ sync, samples with signal / s"),
          ("speedup", "async ÷ sync, trained samples / s"))


def censored(cell: dict[str, Any], minutes: float) -> bool:
    """Whether an arm of a measured cell made fewer than ``MIN_STEPS`` steps a run."""
    m = cell["measured"]
    return m is not None and max(m["sync_step_s"], m["async_step_s"]) * MIN_STEPS > minutes * 60


def series(cells: list[dict[str, Any]], sigma: float, key: str, source: str,
           keep: Any = lambda c: True) -> list[tuple[float, float]]:
    """``(multiple, value)`` of one sigma's cells that ``keep`` takes, the base cell (no environment time) at
    x = 0 for every sigma."""
    out = []
    for c in cells:
        if (c["multiple"] != 0 and c["sigma"] != sigma) or not keep(c):
            continue
        figures = c[source]
        if figures is not None and figures.get(key) is not None:
            out.append((float(c["multiple"]), float(figures[key])))
    return sorted(out)


def plot(data: dict[str, Any], out: Path) -> None:
    cells = data["cells"]
    sigmas = sorted({float(c["sigma"]) for c in cells if c["multiple"] != 0})
    g_ms = data["base"]["per_turn_generation_s"] * 1000
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4))
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for sigma in sigmas:
            color = COLORS.get(sigma, "gray")
            measured = series(cells, sigma, key, "measured", lambda c: not censored(c, data["minutes"]))
            cut = series(cells, sigma, key, "measured", lambda c: censored(c, data["minutes"]))
            predicted = series(cells, sigma, key, "predicted")
            ax.plot([x for x, _ in measured], [y for _, y in measured], color=color, marker="o",
                    label=f"sigma {sigma:g}, measured")
            if cut:
                ax.plot([x for x, _ in cut], [y for _, y in cut], color=color, marker="o", fillstyle="none",
                        linestyle="none", label=f"sigma {sigma:g}, censored (< {MIN_STEPS} steps a run)")
            ax.plot([x for x, _ in predicted], [y for _, y in predicted], color=color, linestyle="--", alpha=0.6,
                    label=f"sigma {sigma:g}, predicted")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("symlog", linthresh=0.25)
        ax.set_xticks([0, 0.25, 1, 4])
        ax.set_xticklabels(["0", "0.25", "1", "4"])
        ax.set_xlabel(f"environment step, median wait (× g = {g_ms:.0f} ms)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{data['model']} policy, {len(data['seeds'])} seeds, {data['minutes']:g} min a run", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("grid", type=Path, help="bench/async_regimes.py's JSON")
    p.add_argument("out", type=Path, help="the PNG to write")
    args = p.parse_args()
    plot(json.loads(args.grid.read_text()), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
