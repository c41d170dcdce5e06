"""Real Kafka and Redis for one pytest session, run through deploy/kafka.sh and deploy/redis.sh.

Lifecycle: after collection, conftest asks :class:`RunInfra` to start the services that the selected
tests need (found from each test's fixture closure), both at once in background threads, so the
broker boots while the unit tests run. A fixture that needs a service waits for its start to finish.
A run of pure unit tests starts nothing. At session end (and, as backstops, at interpreter exit and
on SIGTERM) every service this session started is stopped by its pid file, through the same
scripts (run by :func:`ops.local.launcher.deploy_script`, as the demo's stack runs them); nothing else
is touched. A missing Java, Maven or redis-server is a test failure with the
script's message, never a skip.

A parallel run (pytest-xdist) has one broker and one Redis for all its workers: the workers share
one root (``shared=True``); whichever asks for a service first starts it, under a lock file, and
records it in ``<root>/<name>.json``, where the others find it. The workers never stop them; the
run's controller does at its end (:meth:`RunInfra.adopt`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ops.local.launcher import LaunchError, deploy_script

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

KAFKA = "kafka"
REDIS = "redis"

# A test whose fixture closure holds one of these needs that service.
NEEDS: dict[str, str] = {"kafka_bootstrap": KAFKA, "redis_url": REDIS}

START_TIMEOUT_S = 900.0  # a cold start resolves the Kafka jars from Maven Central first
STOP_TIMEOUT_S = 90.0


class InfraError(Exception):
    """A service could not be started; the message says why and how to fix it."""


@dataclass
class RunService:
    """One service this session owns: its script, data dir and what its start reported."""

    name: str
    script: Path
    data_dir: Path
    address: str = ""
    """Kafka: ``127.0.0.1:PORT`` bootstrap; Redis: ``redis://127.0.0.1:PORT/0``."""
    version: str = ""
    start_s: float = 0.0
    error: str = ""
    stop_note: str = ""
    stopped: bool = False
    pids: list[int] = field(default_factory=list)

    @property
    def pid_file(self) -> Path:
        return self.data_dir / ("pid" if self.name == KAFKA else "redis.pid")


class RunInfra:
    """Starts and stops the test run's Kafka and Redis (a local stack's own are ``ops.local.launcher.Infra``'s);
    thread-safe, every method idempotent."""

    def __init__(self, root: Path | None = None, *, shared: bool = False) -> None:
        self._root_arg = root
        self.shared = shared
        """A worker of a parallel run: services started once for all workers, stopped by the controller."""
        self.root: Path | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future[RunService]] = {}
        self.services: dict[str, RunService] = {}
        self._closed = False

    def workdir(self) -> Path:
        """The root of the services' data dirs (made on first use)."""
        if self.root is None:
            if self._root_arg is not None:
                self._root_arg.mkdir(parents=True, exist_ok=True)
                self.root = self._root_arg
            else:
                self.root = Path(tempfile.mkdtemp(prefix="rein-infra-"))
            if not self.shared:
                atexit.register(self.stop_all)
        return self.root

    @classmethod
    def adopt(cls, root: Path) -> RunInfra:
        """The services the workers of a parallel run started under ``root``, to report and stop."""
        infra = cls(root)
        infra.workdir()
        for record in sorted(root.glob("*.json")):
            svc = _load_record(record)
            infra.services[svc.name] = svc
            done: Future[RunService] = Future()
            done.set_result(svc)
            infra._futures[svc.name] = done
        return infra

    def prestart(self, names: Iterable[str]) -> None:
        """Begin starting each named service not started yet; returns at once."""
        with self._lock:
            if self._closed:
                return
            for name in sorted(set(names)):
                if name in self._futures:
                    continue
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rein-infra")
                script = DEPLOY / f"{name}.sh"
                svc = RunService(name=name, script=script, data_dir=self.workdir() / name)
                self.services[name] = svc
                self._futures[name] = self._pool.submit(self._start, svc)

    def require(self, name: str) -> RunService:
        """The running service, starting it now if nobody asked before; raises InfraError."""
        self.prestart([name])
        svc = self._futures[name].result()
        if svc.error:
            raise InfraError(svc.error)
        return svc

    def _start(self, svc: RunService) -> RunService:
        if not self.shared:
            return self._launch(svc)
        assert self.root is not None
        with (self.root / f"{svc.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be starting it: wait, then take its record
            record = self.root / f"{svc.name}.json"
            if record.exists():
                found = _load_record(record)
                self.services[svc.name] = found
                return found
            self._launch(svc)
            tmp = record.with_suffix(".tmp")
            tmp.write_text(json.dumps({**asdict(svc), "script": str(svc.script), "data_dir": str(svc.data_dir)}))
            tmp.replace(record)
        return svc

    def _launch(self, svc: RunService) -> RunService:
        began = time.monotonic()
        svc.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            fields = deploy_script(svc.script.name, "start", str(svc.data_dir), timeout_s=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            svc.error = f"{svc.script.name} start did not finish within {START_TIMEOUT_S:.0f}s"
            return svc
        except LaunchError as exc:
            svc.error = f"could not start {svc.name} for the integration tests: {exc}"
            return svc
        finally:
            self._record_pid(svc)
        svc.address = fields.get("bootstrap", fields.get("url", ""))
        svc.version = fields.get("version", "?")
        svc.start_s = time.monotonic() - began
        if not svc.address:
            svc.error = f"{svc.script.name} start printed no address: {fields}"
        return svc

    @staticmethod
    def _record_pid(svc: RunService) -> None:
        with contextlib.suppress(OSError, ValueError):
            svc.pids.append(int(svc.pid_file.read_text().strip()))

    def stop_all(self) -> None:
        """Stop every service this session started (by its pid file); safe to call repeatedly. A worker of a
        parallel run only lets its starts finish (the controller stops the services)."""
        with self._lock:
            self._closed = True
            futures = dict(self._futures)
        for name, fut in futures.items():
            try:
                fut.result(timeout=START_TIMEOUT_S)  # a start in flight must finish before it can stop
            except Exception as exc:  # a start crash must not prevent the other stops
                self.services[name].error = self.services[name].error or repr(exc)
        if self.shared:
            return
        threads = [threading.Thread(target=self._stop, args=(svc,)) for svc in self.services.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _stop(self, svc: RunService) -> None:
        if svc.stopped:
            return
        svc.stopped = True
        try:
            deploy_script(svc.script.name, "stop", str(svc.data_dir), timeout_s=STOP_TIMEOUT_S)
            svc.stop_note = "stopped"
        except LaunchError as exc:
            svc.stop_note = f"stop failed: {exc}"
        except subprocess.TimeoutExpired:
            svc.stop_note = "stop script timed out"
        # Backstop: whatever pid this session recorded must be gone; SIGKILL it if not.
        for pid in svc.pids:
            if _alive(pid) and _cmdline_mentions(pid, str(svc.data_dir) if svc.name == KAFKA else "redis"):
                os.kill(pid, 9)
                svc.stop_note += f"; pid {pid} killed"

    def cleanup(self, keep: bool) -> str:
        """Remove the data dirs unless ``keep``; returns a line for the summary."""
        if self.root is None:
            return ""
        if keep:
            return f"service data and logs kept in {self.root}"
        shutil.rmtree(self.root, ignore_errors=True)
        return ""

    def summary(self) -> list[str]:
        lines = []
        for svc in self.services.values():
            if svc.error:
                errors = [ln for ln in svc.error.splitlines() if ": error: " in ln] or svc.error.splitlines()
                lines.append(f"{svc.name}: FAILED TO START: {errors[-1]}")
                continue
            kind = "Apache Kafka (KRaft, single node)" if svc.name == KAFKA else "Redis"
            pid = f"pid {svc.pids[0]}" if svc.pids else "pid ?"
            lines.append(
                f"{kind} {svc.version} at {svc.address} ({pid}), ready in {svc.start_s:.1f}s, "
                f"{svc.stop_note or 'still running'}"
            )
        return lines


def _load_record(path: Path) -> RunService:
    fields = json.loads(path.read_text())
    return RunService(**{**fields, "script": Path(fields["script"]), "data_dir": Path(fields["data_dir"])})


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _cmdline_mentions(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
