"""``bench/time_to_reward.py --runs-dir`` continues a stopped invocation: a finished run is re-read, not
repeated; a failed one is made again; a finished run made with other flags is never overwritten.

The runs here are written by hand (``tests/support/demo_runs.py``): a run the script would start instead
of re-reading fails the test, because no stack can come up in the time it allows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.time_to_reward import finished_run as finished
from tests.support.demo_runs import finished_run

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "time_to_reward.py"


def _flags(mode: str, seed: int) -> list[str]:
    return ["--model", "tiny", "--minutes", "1", "--seed", str(seed), "--mode", mode]


def _finished_run(runs: Path, mode: str, seed: int, reward: float, flags: list[str] | None = None) -> None:
    finished_run(runs, mode, seed, reward=reward, flags=flags if flags is not None else _flags(mode, seed))


def _script(runs: Path, out: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--minutes", "1", "--seeds", "0", "--modes", "sync",
         "async", "--checkpoints", "1", "--episodes", "4", "--threshold", "0.5", "--runs-dir", str(runs),
         "--startup-timeout-s", "1", "--out", str(out), *more],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def test_finished_runs_are_re_read_not_repeated(tmp_path: Path) -> None:
    runs, out = tmp_path / "runs", tmp_path / "ttr.json"
    _finished_run(runs, "sync", 0, reward=0.25)
    _finished_run(runs, "async", 0, reward=0.75)
    proc = _script(runs, out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("finished before, re-read") == 2, proc.stdout
    data = json.loads(out.read_text())
    assert {m: [r["steps"] for r in data["runs"][m]] for m in ("sync", "async")} == {"sync": [3], "async": [3]}
    assert data["runs"]["sync"][0]["reward_at_min"] == {"1": 0.25}
    assert data["runs"]["async"][0]["time_to_threshold_s"] == 10.0
    assert data["runs"]["sync"][0]["time_to_threshold_s"] is None, "never reached: censored, not dropped"
    to_best = data["time_to_sync_best"]
    assert to_best["sync_best"] == 0.25
    assert to_best["modes"]["sync"]["0.5"] == {"level": 0.125, "seconds": [10.0], "reached": 1,
                                               "median_reached_s": 10.0}
    assert to_best["modes"]["async"]["0.9"]["seconds"] == [10.0]


def test_a_finished_run_with_other_flags_is_an_error_not_overwritten(tmp_path: Path) -> None:
    runs, out = tmp_path / "runs", tmp_path / "ttr.json"
    other = [*_flags("sync", 0), "--env-time", "0.5"]
    _finished_run(runs, "sync", 0, reward=0.25, flags=other)
    proc = _script(runs, out)
    assert proc.returncode != 0 and "made with other flags" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert json.loads((runs / "sync-s0" / "flags.json").read_text()) == other
    assert (runs / "sync-s0" / "20261206-000000" / "summary.json").is_file(), "the earlier run is kept"
    assert not out.exists()


def test_a_warm_up_run_is_made_once_and_every_arm_starts_from_its_last_checkpoint(tmp_path: Path) -> None:
    """``--warm-up-steps``: the warm-up (a finished sync run here) is re-read, its last step's checkpoint is the
    ``--init-weights`` every arm was made with (an arm recorded without it would be an error: other flags)."""
    runs, out = tmp_path / "runs", tmp_path / "ttr.json"
    warm = finished_run(runs, "warm", 0, reward=0.1, steps=3, flags=[
        "--model", "tiny", "--steps", "3", "--minutes", "0", "--mode", "sync", "--seed", "0"])
    (runs / "warm-s0").rename(runs / "warm-up")
    warm = runs / "warm-up" / warm.name
    (warm / "weights").mkdir()
    ckpt = warm / "weights" / "v3.pt"
    (warm / "weights" / "v3.json").write_text(json.dumps({"path": str(ckpt), "step": 3}))
    for mode, reward in (("sync", 0.25), ("async", 0.75)):
        _finished_run(runs, mode, 0, reward=reward, flags=[*_flags(mode, 0), "--init-weights", str(ckpt)])
    proc = _script(runs, out, "--warm-up-steps", "3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("finished before, re-read") == 3, proc.stdout
    assert json.loads(out.read_text())["warm_up"] == {"steps": 3, "flags": [], "checkpoint": str(ckpt)}

    again = _script(runs, out, "--warm-up-steps", "2")  # a warm-up made with other flags is kept, not redone
    assert again.returncode != 0 and "made with other flags" in again.stdout + again.stderr


def test_a_run_whose_demo_failed_after_writing_its_summary_is_not_finished(tmp_path: Path) -> None:
    """The demo writes its summary on the way out even when a service died (a full disk killed a trainer this
    way): such a run is made again on resume, never re-read as a result. Runs from before the exit code was
    kept (no ``exit_code`` file) still count."""
    runs = tmp_path / "runs"
    run = finished_run(runs, "sync", 0, reward=0.25, flags=_flags("sync", 0))
    assert finished(run.parent, _flags("sync", 0)) == run
    (run.parent / "exit_code").write_text("1\n")
    assert finished(run.parent, _flags("sync", 0)) is None
    (run.parent / "exit_code").write_text("0\n")
    assert finished(run.parent, _flags("sync", 0)) == run
