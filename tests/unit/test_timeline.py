"""The suite's timeline report (tests/support/timeline.py): modules per worker, the gaps where a worker sat idle,
the modules that cost the most CPU."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.timeline import report


def test_the_report_names_each_workers_modules_its_idle_gaps_and_the_costliest_modules(tmp_path: Path) -> None:
    rows = [
        ("gw0", "tests/e2e/test_a.py::t1", 100.0, 130.0, 1.0, 10.0),
        ("gw0", "tests/e2e/test_a.py::t2", 130.0, 160.0, 0.5, 20.0),
        ("gw0", "tests/unit/test_u.py::t", 200.0, 201.0, 0.25, 0.0),  # 40 s after the last: idle
        ("gw1", "tests/e2e/test_compose.py::t", 300.0, 400.0, 2.0, 5.0),
    ]
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps({"worker": w, "test": t, "start": s, "end": e, "cpu_s": c, "children_cpu_s": k})
                            + "\n" for w, t, s, e, c, k in rows))
    lines = report(path, min_s=15, top=2).splitlines()
    assert lines[0] == "4 tests over 300 s"
    assert lines[1:] == [
        "gw0: busy 61 s",
        "       0 -     60 s  tests/e2e/test_a.py",
        "  idle     60 -    100 s, then tests/unit/test_u.py::t",
        "gw1: busy 100 s",
        "     200 -    300 s  tests/e2e/test_compose.py",
        "CPU-s in tests: workers 4, their children 35; top 2 modules:",
        "    31.5  (worker   1.5, children   30.0)  tests/e2e/test_a.py",
        "     7.0  (worker   2.0, children    5.0)  tests/e2e/test_compose.py",
    ]
