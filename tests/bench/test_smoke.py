"""Every script under ``bench/`` runs once with tiny settings, exits 0 and writes its output.

Benchmarks are not tests: nothing here checks a figure. It checks that each script still
runs against today's code and writes the keys its docs section reads, so none rots between
the runs that produce docs/benchmarks.md. A new script without an entry in ``SMOKE`` fails
:func:`test_every_bench_script_has_a_smoke_entry`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ops.local import warm
from ops.stack_flags import preset_stack
from tests.support.demo_runs import finished_run

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


@dataclass(frozen=True)
class Smoke:
    """How to run one script small: its arguments (given the output path and the fixtures' values),
    the fixtures it needs, and a check of what it wrote."""

    args: Callable[[Path, dict[str, str]], list[str]]
    check: Callable[[Path], None]
    fixtures: tuple[str, ...] = ()
    marks: tuple[pytest.MarkDecorator, ...] = field(default_factory=tuple)
    timeout_s: float = 240


def _json(path: Path, *keys: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return _has(data, path.name, *keys)


def _has(data: dict[str, Any], name: str, *keys: str) -> dict[str, Any]:
    missing = [k for k in keys if k not in data]
    assert not missing, f"{name} lacks {missing}: {sorted(data)}"
    return data


def _engine_decode(out: Path) -> None:
    data = _json(out, "model", "threads", "rows")
    assert [r["concurrency"] for r in data["rows"]] == [1, 2]
    assert all(r["kv_cache_tok_s"] > 0 and r["recompute_tok_s"] > 0 for r in data["rows"])


def _engine_vs_generate(out: Path) -> None:
    data = _json(out, "model", "threads", "concurrency", "prompt_lengths", "new_tokens", "rows")
    assert data["prompt_lengths"] == [4, 8, 12]
    assert [r["variant"] for r in data["rows"]] == ["generate", "engine pad=0", "engine pad=1"]
    assert all(r["tok_s"] > 0 and r["over_generate"] > 0 for r in data["rows"])
    assert all(0 <= r["agree"] <= 1 and r["prefill_s"] > 0 for r in data["rows"][1:])


def _trainer_ranks(data: dict[str, Any]) -> None:
    """What bench/trainer_ranks.py writes (``scale_out`` runs it)."""
    _has(data, "trainer_ranks.json", "model", "samples", "threads", "rows")
    assert [r["variant"] for r in data["rows"]] == ["1 rank", "2 ranks"]
    assert all(r["step_s"] > 0 for r in data["rows"]) and data["rows"][0]["x_one_rank"] == 1.0


def _scale_out(out: Path) -> None:
    data = _json(out, "collectors", "proxies", "trainer")
    assert [r["replicas"] for r in data["collectors"]] == [1, 2]
    assert all(r["groups_per_s"] > 0 for r in data["collectors"])
    assert [r["proxies"] for r in data["proxies"]] == [1, 2] and all(r["calls"] > 0 for r in data["proxies"])
    _trainer_ranks(data["trainer"])


def _tool_call_share(out: Path) -> None:
    data = _json(out, "model", "prompts", "samples", "rows")
    assert [r["temperature"] for r in data["rows"]] == [1.0, 0.0]
    assert all(r["replies"] == 4 and 0 <= r["call_share"] <= 1 for r in data["rows"])


def _task_signal(out: Path) -> None:
    data = _json(out, "model", "prompts", "samples", "rows")
    assert [r["max_operand"] for r in data["rows"]] == [9, 2]
    assert all(r["episodes"] == 4 and 0 <= r["signal_past_format"] <= r["signal"] <= 1 for r in data["rows"])


def _collector(out: Path) -> None:
    data = _json(out, "throughput", "decision_cost")
    assert [r["replicas"] for r in data["throughput"]] == [1, 2]
    assert all(r["groups_per_s"] > 0 for r in data["throughput"])
    assert [d["registered_versions"] for d in data["decision_cost"]] == [10, 100]


def _proxy(out: Path) -> None:
    data = _json(out, "overhead", "stall", "args")
    over = data["overhead"]
    assert over["max_tokens"] == 1
    for key in ("direct_ms", "passthrough_ms", "proxy_ms", "proxy_no_kafka_ms", "overhead_over_passthrough"):
        assert set(over[key]) == {"p50", "p99"}, key
    assert data["stall"]["rounds"] == 1 and data["stall"]["p50"]["stall_ms"] > 0


def _inprocess(out: Path) -> None:
    data = _json(out, "steps", "wall_s", "episodes_per_s", "reward_first", "reward_last", "reward_at", "rows")
    tiny = preset_stack("tiny")
    batch = tiny.batch_groups * tiny.setting("rollout", "group_size")
    assert data["steps"] == 3 and data["episodes"] == 3 * batch, "the demo's batch"
    assert data["episodes_per_s"] > 0
    assert set(data["reward_at"]) == {"1", "1000"}


def _pipeline(out: Path) -> None:
    data = _json(out, "pipeline", "inprocess", "pipeline_over_inprocess")
    demo = data["pipeline"]
    assert demo["steps"] == 3 and data["inprocess"]["steps"] == 3
    assert data["pipeline_over_inprocess"] > 0
    expected = {"proxy", "engine", "rollout", "trainer", "broadcaster", "collector-0", "collector-1", "kafka", "redis"}
    assert set(demo["cpu"]) == expected
    assert sum(r["share"] for r in demo["cpu"].values()) == pytest.approx(1.0, abs=0.01)
    assert demo["cpu"]["proxy"]["cpu_s"] > 0
    assert demo["last_version_served"], "v3 was served before the stack stopped"
    assert 1 <= demo["stall"]["updates"] <= 3, "one stall per update the broadcaster applied (v1..v3)"
    assert demo["stall"]["p50_ms"] > 0


def _hot_path(out: Path) -> None:
    data = _json(out, "wall_s", "chat_calls", "episodes_per_s", "busy_cpu_s", "processes", "idle_cpu_ms_per_s")
    assert data["chat_calls"] > 0 and data["episodes_per_s"] > 0
    rows = {r["process"]: r for r in data["processes"]}
    assert {"proxy", "rollout", "engine", "kafka"} <= set(rows)
    assert set(data["idle_cpu_ms_per_s"]) == set(rows) and data["idle_cpu_ms_per_s"]["rollout"] == 0, "stopped"
    assert rows["proxy"]["cpu_ms_per_chat"] > 0


def _trainer_step(out: Path) -> None:
    data = _json(out, "model", "threads", "positions", "trained_tokens", "seconds", "ratios")
    assert data["rounds"] == 1 and 0 < data["trained_tokens"] < data["positions"]
    assert set(data["seconds"]) == {"rein", "plain", "full"} and all(s["median"] > 0 for s in data["seconds"].values())
    assert set(data["ratios"]) == {"rein_over_plain", "full_over_plain"}


def _time_to_reward(out: Path) -> None:
    data = _json(out, "model", "minutes", "seeds", "threshold", "aggregate", "runs", "modes")
    assert set(data["aggregate"]) == set(data["runs"]) == {"sync", "async"}
    for mode, runs in data["runs"].items():
        [run] = runs
        assert run["steps"] >= 1 and run["episodes"] > 0, mode
        assert set(run["reward_at_min"]) == {"0.1"}
        assert run["trained_tokens_per_s"] > 0 and run["curve"], mode
    assert data["runs"]["async"][0]["waste"]["generated"] > 0, "async decides groups through the window tally"


def _async_regimes(out: Path) -> None:
    data = _json(out, "base", "cells", "wave", "group", "in_flight", "runs_to_do")
    assert data["base"]["per_turn_generation_s"] > 0
    base, *cells = data["cells"]
    assert base["measured"] is not None and all(c["measured"] is None for c in cells), "--predict-only runs nothing"
    assert data["runs_to_do"] == 2 * len(cells) == 4
    assert all(c["predicted"]["sync_step_s"] > base["predicted"]["sync_step_s"] for c in cells)


@pytest.fixture
def ttr_base_runs(tmp_path: Path) -> Path:
    """The base cell of bench/async_regimes.py, finished: sync and async, seed 0, written by hand."""
    runs = tmp_path / "regimes"
    for mode, step_s in (("sync", 10.0), ("async", 8.0)):  # the flags bench/async_regimes.py's smoke run gives
        flags = ["--model", "tiny", "--minutes", "0.5", "--seed", "0", "--mode", mode]
        finished_run(runs / "env0-sigma0", mode, 0, reward=0.25, flags=flags, step_s=step_s)
    return runs


@pytest.fixture
def ttr_sync_run(tmp_path: Path) -> Path:
    """The sync arm of the ``time_to_reward`` smoke, finished, written by hand: the script re-reads it and runs only
    the async arm, so the smoke starts one demo stack, not two. What the sync run would add, a tiny demo in sync
    mode, is the sync whole stack of tests/e2e/test_smollm2.py on the same launcher (``ops.local.stack``)."""
    runs = tmp_path / "ttr"
    finished_run(runs, "sync", 0, reward=0.25, step_s=1.0, train_s=0.2,  # 3 steps inside the 6-s budget
                 flags=["--model", "tiny", "--minutes", "0.1", "--seed", "0", "--mode", "sync"])
    return runs


STRESS_ARMS = {"sync": ["--mode", "sync"], "async-none": ["--mode", "async", "--keep-versions", "0", "--max-preempts",
               "none", "--pacing", "off", "--nonlast-version-tokens", "weight"], "async": ["--mode", "async"]}
"""bench/time_to_reward.py's flags of bench/stress.py's arms, as ``flags.json`` records them."""


@pytest.fixture
def stress_runs(tmp_path: Path) -> Path:
    """bench/stress.py's three arms, seed 0, finished, written by hand: each scores its own constant reward."""
    runs = tmp_path / "stress"
    for arm, reward in (("sync", 0.25), ("async-none", 0.1), ("async", 0.2)):
        flags = ["--model", "tiny", "--minutes", "0.5", "--seed", "0", *STRESS_ARMS[arm], "--lr=0.003"]
        finished_run(runs, arm, 0, reward=reward, flags=flags)
    return runs


def _stress(out: Path) -> None:
    data = _json(out, "per_seed", "runs", "stress")
    shares = data["per_seed"]["0"]["share_of_sync"]
    assert set(shares) == {"sync", "async-none", "async"} and shares["sync"] == 1.0
    assert all({"curve", "signal_samples", "version_gap_mean"} <= set(r[0]) for r in data["runs"].values())


def _plot_regimes(out: Path) -> None:
    assert out.stat().st_size > 0


def _plot_controls(out: Path) -> None:
    assert out.stat().st_size > 0


SMOKE: dict[str, Smoke] = {
    "engine_decode": Smoke(
        lambda out, _: ["--concurrency", "1", "2", "--new-tokens", "4", "--out", str(out)], _engine_decode,
    ),
    "engine_vs_generate": Smoke(
        lambda out, _: ["--concurrency", "3", "--min-len", "4", "--max-len", "12", "--new-tokens", "3",
                        "--paddings", "0", "1", "--rounds", "1", "--out", str(out)],
        _engine_vs_generate,
    ),
    "inprocess": Smoke(lambda out, _: ["--steps", "3", "--at", "1", "1000", "--out", str(out)], _inprocess),
    "async_regimes": Smoke(
        lambda out, fx: ["--runs-dir", fx["ttr_base_runs"], "--minutes", "0.5", "--predict-only", "--cells", "1:0",
                         "4:2", "--draws", "50", "--out", str(out)],
        _async_regimes, fixtures=("ttr_base_runs",),
    ),
    "stress": Smoke(
        lambda out, fx: ["--runs-dir", fx["stress_runs"], "--minutes", "0.5", "--stress=--lr=0.003",
                         "--episodes", "4", "--startup-timeout-s", "1", "--out", str(out)],
        _stress, fixtures=("stress_runs",),
    ),
    "plot_controls": Smoke(lambda out, _: [str(BENCH / "controls.json"), str(out)], _plot_controls),
    "plot_regimes": Smoke(lambda out, _: [str(BENCH / "async_regimes.json"), str(out)], _plot_regimes),
    "trainer_step": Smoke(
        lambda out, _: ["--tiny-llama", "--samples", "2", "--min-len", "16", "--max-len", "24", "--rounds", "1",
                        "--threads", "1", "--out", str(out)],
        _trainer_step,
    ),
    "collector": Smoke(
        lambda out, fx: ["--bootstrap", fx["kafka_bootstrap"], "--redis-url", fx["redis_db_url"], "--groups", "4",
                         "--steps", "10", "--versions", "10", "100", "--json", str(out)],
        _collector, fixtures=("kafka_bootstrap", "redis_db_url"), marks=(pytest.mark.integration,),
    ),
    "proxy": Smoke(
        lambda out, fx: ["--kafka", fx["kafka_bootstrap"], "--requests", "5", "--warmup", "1", "--max-tokens", "1",
                         "--rounds", "1", "--inflight", "2", "--out", str(out)],
        _proxy, fixtures=("kafka_bootstrap",), marks=(pytest.mark.integration,),
    ),
    "pipeline": Smoke(
        lambda out, _: ["--compare", "demo", "--steps", "3", "--timeout-s", "240", "--out", str(out)],
        _pipeline, marks=(pytest.mark.integration, pytest.mark.slow), timeout_s=280,
    ),
    "time_to_reward": Smoke(
        lambda out, fx: ["--model", "tiny", "--minutes", "0.1", "--seeds", "0", "--modes", "sync", "async",
                         "--checkpoints", "0.1", "--episodes", "8", "--threshold", "0.5", "--runs-dir",
                         fx["ttr_sync_run"], "--out", str(out), "--plot", str(out.with_suffix(".png"))],
        _time_to_reward, fixtures=("ttr_sync_run",), marks=(pytest.mark.integration, pytest.mark.slow), timeout_s=280,
    ),
    "scale_out": Smoke(
        lambda out, fx: ["--bootstrap", fx["kafka_bootstrap"], "--redis-url", fx["redis_db_url"], "--groups", "10",
                         "--collectors", "1", "2", "--seconds", "3", "--concurrency", "2", "--trainer-samples", "3",
                         "--trainer-rounds", "1", "--out", str(out), "--trainer-args", "--min-len", "16", "--max-len",
                         "24"],
        _scale_out, fixtures=("kafka_bootstrap", "redis_db_url"), marks=(pytest.mark.integration,), timeout_s=420,
    ),
    "tool_call_share": Smoke(
        lambda out, fx: ["--model", fx["tiny_llama_dir"], "--prompts", "2", "--samples", "2", "--temperatures", "1",
                         "0", "--max-tokens", "4", "--threads", "1", "--demonstration", "--out", str(out)],
        _tool_call_share, fixtures=("tiny_llama_dir",),
    ),
    "task_signal": Smoke(
        lambda out, fx: ["--model", fx["tiny_llama_dir"], "--prompts", "2", "--samples", "2", "--max-operands", "9",
                         "2", "--max-tokens", "4", "--out", str(out)],
        _task_signal, fixtures=("tiny_llama_dir",),
    ),
    "hot_path": Smoke(
        lambda out, _: ["--warmup", "1", "--steps", "2", "--idle", "1", "--timeout-s", "240", "--out", str(out)],
        _hot_path, marks=(pytest.mark.integration, pytest.mark.slow), timeout_s=280,
    ),
}
"""Script name (``bench/<name>.py``) -> its smoke run. ``pipeline``, ``hot_path`` and ``time_to_reward`` start
their own Kafka and Redis (the demo's stack); the others that need them take the session's."""

RUN_BY_ANOTHER = {"trainer_ranks": "scale_out"}
"""Scripts whose smoke run is another's: ``scale_out`` runs ``bench/trainer_ranks.py`` (``--tiny-llama --samples 3
--rounds 1 --min-len 16 --max-len 24``: one rank, then two under torchrun) and its check reads what it wrote with
:func:`_trainer_ranks`; a run of its own would repeat that, three torch processes more."""


def test_every_bench_script_has_a_smoke_entry() -> None:
    """A script is a bench/*.py with a ``__main__`` guard; the rest are modules the scripts share."""
    scripts = sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
    covered = sorted({*SMOKE, *RUN_BY_ANOTHER})
    assert scripts == covered, f"bench/ scripts without a smoke entry: {sorted(set(scripts) - set(covered))}"
    assert set(RUN_BY_ANOTHER.values()) <= set(SMOKE)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[*smoke.marks, pytest.mark.timeout(smoke.timeout_s + 30)])
             for name, smoke in SMOKE.items()]
)
def test_bench_script_runs(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    smoke = SMOKE[name]
    fixtures = {f: str(request.getfixturevalue(f)) for f in smoke.fixtures}
    out = tmp_path / (f"{name}.png" if name.startswith("plot_") else f"{name}.json")
    code, output = _run_script(BENCH / f"{name}.py", smoke.args(out, fixtures), tmp_path, smoke.timeout_s)
    assert code == 0, f"bench/{name}.py exited {code}:\n{output[-6000:]}"
    assert out.exists(), f"bench/{name}.py wrote no {out.name}:\n{output[-2000:]}"
    smoke.check(out)


def _run_script(script: Path, args: list[str], log_dir: Path, timeout_s: float) -> tuple[int, str]:
    """``python script args`` with this process's environment: forked from the worker's warm server
    (``ops/local/warm.py``: torch and the services imported once, ~2 CPU-s less a script) or exec'd. Its
    exit code and its output (stdout and stderr together)."""
    if not warm.enabled():
        done = subprocess.run([sys.executable, str(script), *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False)
        return done.returncode, done.stdout
    log = log_dir / f"{script.stem}.out"
    server = warm.server(REPO, log_dir)
    child = server.spawn(warm.Spec((str(script), *args), dict(os.environ), str(REPO), str(log), False))
    try:
        code = child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(30)
        raise
    return code, log.read_text(errors="replace") if log.exists() else ""
