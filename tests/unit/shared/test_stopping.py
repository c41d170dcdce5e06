"""The stop's bound (shared/stopping.py): the process exits 0 once it is spent, whatever its main thread does."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

BLOCKED = """
import threading, time
from shared import log
from shared.stopping import exit_after
log.configure("test", "info", json=True)
exit_after(0.3, "test")
exit_after(30.0, "test")  # armed once: a second stop signal does not move the bound
threading.Event().wait(60)  # the main thread blocked, as on a dead broker's request timeout
"""


def test_a_blocked_process_exits_zero_once_the_bound_is_spent() -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", BLOCKED], cwd=REPO, capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert took < 10, f"exited after {took:.1f}s"  # 0.3 s plus the interpreter's start
    logged = done.stdout + done.stderr
    assert '"event": "stop_forced"' in logged and '"service": "test"' in logged, logged
