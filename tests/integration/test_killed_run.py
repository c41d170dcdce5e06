"""A test run killed with SIGKILL (CI's time limit past its grace, a second Ctrl-C) leaves no process behind.

The run's services sit in process groups of their own and outlive it; ``tests/support/reaper.py``, which
every run starts first, stops every process left in the run's cgroup once the run is gone. Here a pytest
of its own runs ``tests/support/killed_run_probe.py`` (Kafka, Redis and an engine started, then held), is
SIGKILLed, and every one of its processes (found by name in /proc, whatever its cgroup) must be gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import REPO_ROOT
from tests.support.reaper import cgroup_of, members
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _listed(group: Path) -> list[tuple[int, str]]:
    try:
        return [(int(p), _comm(int(p))) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if _comm(p)]


def test_a_run_killed_with_sigkill_leaves_no_process_behind(tmp_path: Path) -> None:
    out, log = tmp_path / "probe.json", tmp_path / "run.log"
    env = {**os.environ, "PROBE_OUT": str(out)}
    with log.open("wb") as sink:
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--timeout", "600",
             "tests/support/killed_run_probe.py"],
            cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        probe = wait_until(lambda: out.exists() and json.loads(out.read_text()), 300, "the probe's services",
                           details=lambda: log.read_text()[-3000:])
        assert cgroup_of(probe["mark"]).is_dir(), "the run joined a cgroup of its own"
        before = members(probe["mark"])
        names = sorted(_comm(p) for p in before)
        assert probe["engine"] in before, f"the engine is among the run's processes: {names}"
        assert "java" in names and "redis-server" in names, f"Kafka and Redis are among them: {names}"
    finally:
        os.kill(run.pid, signal.SIGKILL)
        run.wait(30)
    killed = time.monotonic()
    wait_until(lambda: not _alive(before), 60, "every process of the killed run to be gone",
               details=lambda: f"still there: {[(p, _comm(p)) for p in _alive(before)]}")
    gone_s = time.monotonic() - killed
    group = cgroup_of(probe["mark"])
    wait_until(lambda: not group.exists(), 60, "the run's cgroup to be removed",
               details=lambda: f"left in it: {_listed(group)}")
    print(f"\nkilled run: {len(before)} processes ({', '.join(names)}) gone {gone_s:.1f} s after the SIGKILL")
