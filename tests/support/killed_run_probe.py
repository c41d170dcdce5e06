"""A run to be killed (not collected by the suite: no ``test_`` prefix). ``tests/integration/test_killed_run.py``
runs this file in a pytest of its own, waits for what it writes, and SIGKILLs that pytest."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from tests.support.stack import engine_process


def test_hold_a_broker_redis_and_a_service(kafka_bootstrap: str, redis_url: str, tmp_path: Path) -> None:
    with engine_process(tmp_path / "weights", tmp_path / "logs") as engine:
        out = Path(os.environ["PROBE_OUT"])
        staged = out.with_suffix(".partial")  # renamed whole: the test polls and must never read half a file
        staged.write_text(json.dumps({
            "mark": os.environ["PYTEST_REIN_RUN"], "engine": engine.proc.process.pid,
            "kafka": kafka_bootstrap, "redis": redis_url}))
        staged.replace(out)
        threading.Event().wait(300)  # until killed (bounded: a probe never killed still ends)
