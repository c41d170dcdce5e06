"""A pytest plugin that writes each test's start and end, per xdist worker, as JSON lines.

``PYTEST_ARGS="-p tests.support.timeline" PYTEST_TIMELINE=/tmp/timeline.jsonl bash .ci/run``, then
``python -m tests.support.timeline /tmp/timeline.jsonl``: which units each worker ran, when, and where
a worker sat idle (docs/development.md). Nothing is written unless ``PYTEST_TIMELINE`` is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

_started: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _started[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    out = os.environ.get("PYTEST_TIMELINE")
    if not out:
        return
    row = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": nodeid,
           "start": _started.pop(nodeid, time.time()), "end": time.time()}
    with open(out, "a") as handle:  # one short line per write: appends from the workers do not interleave
        handle.write(json.dumps(row) + "\n")


def report(path: Path, min_s: float = 15.0) -> str:
    """Per worker: busy seconds, and each module that ran at least ``min_s`` (start and end, from the run's
    first test), then idle gaps over 5 s between tests."""
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
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--min-s", type=float, default=15.0)
    args = parser.parse_args()
    print(report(args.timeline, args.min_s))
