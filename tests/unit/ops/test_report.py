"""``rein report`` and :mod:`ops.report`: a recorded run renders to a PNG; a live metrics file is read as it grows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ops.cli import main
from ops.report import MetricsTail, load_metrics, plot_run, present_panels, read_metrics, series, waste

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(n: int = 12) -> list[dict[str, Any]]:
    rows = []
    for step in range(1, n + 1):
        rows.append(
            {
                "step": step,
                "reward_mean": step / n,
                "loss": 1.0 / step,
                "train_rollout_logprob_abs_diff": 0.01 * step,
                "version_gap_min": 0,
                "version_gap_max": step % 3,
                "version_gap_mean": (step % 3) / 2,
                "masked_token_fraction": 0.05,
                "drops_in_batch": step % 2,
                "drops_cumulative": step // 2,
                "rejected_sessions": 0,
                "some_future_field": {"nested": True},
            }
        )
    return rows


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 5_000  # a real figure, not an empty canvas


def test_cli_report_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run1"
    run.mkdir()
    _write(run / "metrics.jsonl", [json.dumps(r) for r in _rows()])

    assert main(["report", str(run)]) == 0

    out = capsys.readouterr().out.strip().splitlines()
    assert out == [str(run / "report.png")]
    _assert_png(run / "report.png")


def test_cli_report_skips_malformed_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run2"
    run.mkdir()
    good = [json.dumps(r) for r in _rows(6)]
    _write(run / "metrics.jsonl", [good[0], "{not json", good[1], "", "[1, 2]", *good[2:], '{"step": 7, "rew'])
    out_dir = tmp_path / "plots"

    assert main(["report", str(run), "--out", str(out_dir)]) == 0

    captured = capsys.readouterr()
    assert captured.out.strip() == str(out_dir / "report.png")
    assert "skipped 3 malformed lines" in captured.err
    _assert_png(out_dir / "report.png")


def test_cli_report_missing_or_empty_run_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
    _write(tmp_path / "metrics.jsonl", ["garbage"])
    assert main(["report", str(tmp_path)]) == 1
    assert "no metrics rows" in capsys.readouterr().err
    assert not (tmp_path / "report.png").exists()


def test_load_metrics_counts_malformed(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", ['{"step": 1}', "nope", '"a string"', "", '{"step": 2}'])
    assert load_metrics(path) == [{"step": 1}, {"step": 2}]
    assert read_metrics(path).malformed == 2


@pytest.mark.parametrize(
    ("rows", "titles"),
    [
        ([{"step": 1, "reward_mean": 0.5}], ["reward"]),
        ([{"step": 1, "drops_cumulative": 3}], ["drops"]),
        ([{"step": 1, "untrained_window_cumulative": 3}], ["untrained tokens"]),
        ([{"step": 1, "version_masked_tokens": 3}], ["untrained tokens"]),
        ([{"step": 1, "version_gap_max": 2}, {"step": 2, "loss": 0.1}], ["version gap", "loss"]),
        ([{"step": 1, "reward_mean": None, "unknown": 1}], []),
        ([{"step": 1, "reward_mean": "high"}, {"step": 2, "reward_mean": True}], []),
    ],
)
def test_only_present_metrics_get_panels(rows: list[dict[str, Any]], titles: list[str]) -> None:
    assert [p.title for p in present_panels(rows)] == titles


def test_series_uses_line_number_without_step() -> None:
    rows: list[dict[str, Any]] = [{"reward_mean": 1.0}, {"step": 10, "reward_mean": 2.0}, {"reward_mean": float("nan")}]
    assert series(rows, "reward_mean") == ([0.0, 10.0], [1.0, 2.0])


@pytest.mark.parametrize("rows", [[], [{"step": 1}], [{"step": 1, "reward_mean": 0.1}]])
def test_plot_run_always_writes_a_png(tmp_path: Path, rows: list[dict[str, Any]]) -> None:
    out = plot_run(rows, tmp_path / "sub" / "r.png", "title")
    assert out == tmp_path / "sub" / "r.png"
    assert out.read_bytes().startswith(PNG_MAGIC)


WASTE_ROWS: list[dict[str, Any]] = [
    {"step": 1, "version_masked_tokens": 2},  # a manifest from a collector without the tally
    {"step": 2, "version_masked_tokens": 3, "generated_tokens_cumulative": 100, "untrained_window_cumulative": 10,
     "untrained_no_signal_cumulative": 5, "untrained_failed_cumulative": 0},
    {"step": 2, "skipped": "no_signal", "version_masked_tokens": 0, "trainable_tokens": 7,
     "generated_tokens_cumulative": 180,
     "untrained_window_cumulative": 12, "untrained_no_signal_cumulative": 20, "untrained_failed_cumulative": 8,
     "untrained_withheld_cumulative": 4},
]


def test_waste_takes_the_last_tally_and_sums_the_masked_tokens() -> None:
    assert waste(WASTE_ROWS) == {
        "tokens": {"window": 12, "no_signal": 20, "failed": 8, "withheld": 4, "masked": 5, "skipped": 7},
        "untrained": 56,
        "generated": 180,
        "share": round(56 / 180, 4),
    }
    assert waste(WASTE_ROWS[:1]) is None and waste([]) is None


def test_the_untrained_panel_sums_the_masked_tokens(tmp_path: Path) -> None:
    assert series(WASTE_ROWS, "untrained_failed_cumulative") == ([2.0, 2.0], [0.0, 8.0])
    assert [p.title for p in present_panels(WASTE_ROWS)] == ["untrained tokens"]
    _assert_png(plot_run(WASTE_ROWS * 4, tmp_path / "w.png", "waste"))


def test_metrics_tail_reads_complete_lines_as_the_file_grows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # not written yet
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')  # a line the trainer is still writing
    assert [r["step"] for r in tail.read()] == [1, 2]
    with path.open("a") as fh:
        fh.write('p": 3}\nnot json\n[4]\n\n{"step": 5}\n')
    assert [r["step"] for r in tail.read()] == [1, 2, 3, 5]
    assert tail.read() == read_metrics(path).rows
    path.write_text('{"step": 9}\n')  # shorter than what was read: read again from the start
    assert [r["step"] for r in tail.read()] == [9]
