"""Start a rein service as a real subprocess and wait until it is healthy.

Used by integration tests (engine, proxy, ...). The child runs ``python -m <module>``
from the repository root with the parent's environment minus every ``REIN_*``
variable, plus ``env``: tests are hermetic whatever the developer's shell exports.
stdout and stderr go to a log file whose tail is shown when the service fails to
start. ``Proc.stop()`` terminates, waits (bounded), then kills: only this PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServiceStartError(RuntimeError):
    """The service exited or never became healthy; the message carries its log tail."""


@dataclass
class Proc:
    module: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log_file: IO[bytes] | None = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Idempotent; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)
        if self._log_file is not None:
            self._log_file.close()
        return self.popen.returncode


def start_service(
    module: str,
    env: dict[str, str],
    health_url: str,
    timeout_s: float = 60,
    log_dir: Path | None = None,
) -> Proc:
    """Run ``python -m module`` and block until ``GET health_url`` answers 200.

    Raises ServiceStartError (with the log tail) if the process exits or the deadline
    passes; the process is stopped first in both cases.
    """
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rein-proc-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{module.replace('.', '_')}-{os.getpid()}-{time.monotonic_ns()}.log"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")}
    child_env.update(env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    log_file = log_path.open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", module],
        cwd=REPO_ROOT,
        env=child_env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    proc = Proc(module=module, popen=popen, log_path=log_path, _log_file=log_file)
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    with httpx.Client(timeout=2.0) as client:
        while True:
            if not proc.alive():
                proc.stop()
                raise ServiceStartError(
                    f"{module} exited with code {proc.popen.returncode} before {health_url} was healthy; "
                    f"log {log_path}:\n{proc.tail()}"
                )
            try:
                response = client.get(health_url)
                if response.status_code == 200:
                    return proc
                last_error = f"status {response.status_code}"
            except httpx.TransportError as exc:
                last_error = repr(exc)
            if time.monotonic() > deadline:
                proc.stop()
                raise ServiceStartError(
                    f"{module} not healthy at {health_url} after {timeout_s}s ({last_error}); "
                    f"log {log_path}:\n{proc.tail()}"
                )
            time.sleep(0.1)
