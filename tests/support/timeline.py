"""A pytest plugin that writes each test's start and end, per xdist worker, as JSON lines.

``PYTEST_ARGS="-p tests.support.timeline" PYTEST_TIMELINE=/tmp/timeline.jsonl bash .ci/run``, then
``python -m tests.support.timeline /tmp/timeline.jsonl``: which units each worker ran, when, where a worker
sat idle, and the modules that cost the most CPU (docs/development.md). A test's CPU is its worker's own over
the test plus that of the worker's child processes that ended in it (a module's services stopped at its end
count in its last test; brokers and containers, which are not the worker's children, are not counted, nor are
services forked by a warm server, which are the server's: ``REIN_WARM_START=0`` execs them, counted again).
Nothing is written unless ``PYTEST_TIMELINE`` is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

_started: dict[str, tuple[float, os.times_result]] = {}


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _started[nodeid] = time.time(), os.times()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    out = os.environ.get("PYTEST_TIMELINE")
    if not out:
        return
    start, cpu = _started.pop(nodeid, (time.time(), os.times()))
    now = os.times()
    kids = now.children_user + now.children_system - cpu.children_user - cpu.children_system
    row = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": nodeid, "start": start, "end": time.time(),
           "cpu_s": round(now.user + now.system - cpu.user - cpu.system, 2), "children_cpu_s": round(kids, 2)}
    with open(out, "a") as handle:  # one short line per write: appends from the workers do not interleave
        handle.write(json.dumps(row) + "\n")


def report(path: Path, min_s: float = 15.0, top: int = 15) -> str:
    """Per worker: busy seconds, and each module that ran at least ``min_s`` (start and end, from the run's
    first test), then idle gaps over 5 s between tests; then the ``top`` modules by CPU."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["worker"] != "main"] or rows
    t0 = min(r["start"] for r in rows)
    lines = [f"{len(rows)} tests over {max(r['end'] for r in rows) - t0:.0f} s"]
    for worker in sorted({r["worker"] for r in rows}):
        mine = sorted((r for r in rows if r["worker"] == worker), key=lambda r: r["start"])
        busy = sum(r["end"] - r["start"] for r in mine)
        lines.append(f"{worker}: busy {busy:.0f} s")
        spans: list[tuple[str, float, float]] = []
        for r in mine:
            module = r["test"].split("::", 1)[0]
            if spans and spans[-1][0] == module:
                spans[-1] = (module, spans[-1][1], r["end"] - t0)
            else:
                spans.append((module, r["start"] - t0, r["end"] - t0))
        lines += [f"  {start:6.0f} - {end:6.0f} s  {module}" for module, start, end in spans if end - start >= min_s]
        for before, after in itertools.pairwise(mine):
            if after["start"] - before["end"] > 5:
                lines.append(f"  idle {before['end'] - t0:6.0f} - {after['start'] - t0:6.0f} s, then {after['test']}")
    cpu: dict[str, list[float]] = {}
    for r in rows:
        mod = cpu.setdefault(r["test"].split("::", 1)[0], [0.0, 0.0])
        mod[0] += r.get("cpu_s", 0.0)
        mod[1] += r.get("children_cpu_s", 0.0)
    worker_s, children_s = sum(c[0] for c in cpu.values()), sum(c[1] for c in cpu.values())
    lines.append(f"CPU-s in tests: workers {worker_s:.0f}, their children {children_s:.0f}; top {top} modules:")
    ranked = sorted(cpu.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines += [f"  {own + kids:6.1f}  (worker {own:5.1f}, children {kids:6.1f})  {module}"
              for module, (own, kids) in ranked]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--min-s", type=float, default=15.0)
    parser.add_argument("--top", type=int, default=15, help="modules listed by CPU")
    args = parser.parse_args()
    print(report(args.timeline, args.min_s, args.top))
