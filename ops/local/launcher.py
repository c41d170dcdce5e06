"""Local processes without Docker: Kafka, Redis and rein services as child processes.

The one process launcher: ``make demo``, ``rein up`` / ``rein down``, the end-to-end
tests (through :mod:`ops.local.stack`) and the integration tests (:func:`start_service`)
start services with :class:`Service`. A child runs ``python -m <module>`` from the
repository root with this process's environment minus every ``REIN_*`` variable plus its
own, so a run is hermetic whatever the shell exports; exec'd, or with ``REIN_WARM_START=1``
forked from a server that imported every service once (:mod:`ops.local.warm`). Each process writes its log to a
file whose tail is shown when it fails to start; everything started is stopped by PID
(never a broad ``pkill``), in reverse order, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from ops.local import warm
from shared import log
from shared.settings import RedisSettings, child_env, with_env

_log = log.get(__name__)
REPO = Path(__file__).resolve().parents[2]


class Child(Protocol):
    """A started service: a :class:`subprocess.Popen`, or a :class:`ops.local.warm.Child` forked by a warm server."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class LaunchError(RuntimeError):
    """A process did not start or did not become healthy in time; the message has its log tail."""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def deploy_script(name: str, *args: str, timeout_s: float = 180, env: dict[str, str] | None = None) -> dict[str, str]:
    """Run a deploy/ script (``kafka.sh``, ``redis.sh``) and parse its ``key=value`` stdout lines; LaunchError
    with its output when it fails, ``subprocess.TimeoutExpired`` past ``timeout_s``. The one wrapper of those
    scripts: the demo's stack and the test session's services (``tests/support/infra.py``) both use it."""
    proc = subprocess.run(
        ["bash", str(REPO / "deploy" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
        env=None if env is None else with_env(env),
    )
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        raise LaunchError(f"`bash deploy/{name} {' '.join(args)}` exited {proc.returncode}:\n{output[-3000:]}")
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


@dataclass
class Infra:
    """A running Kafka broker and Redis server under ``data_dir``."""

    data_dir: Path
    kafka_bootstrap: str = ""
    redis_url: str = ""
    redis_sentinels: list[str] = field(default_factory=list)
    """With ``redis_failover``: the Sentinels that know the primary (``redis_url`` is the primary it started with)."""
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, data_dir: Path, kafka_brokers: int = 1, redis_failover: bool = False) -> Infra:
        """Redis and Kafka: one node, or ``kafka_brokers`` nodes in one KRaft quorum (replication 3); one
        Redis, or (``redis_failover``) a primary, two replicas and three Sentinels."""
        infra = cls(data_dir)
        (data_dir / "kafka").mkdir(parents=True, exist_ok=True)
        (data_dir / "redis").mkdir(parents=True, exist_ok=True)
        deploy_script("kafka.sh", "fetch", timeout_s=900)
        deploy_script("redis.sh", "install", timeout_s=900)
        try:
            failover = ["--failover"] if redis_failover else []
            redis = deploy_script("redis.sh", "start", str(data_dir / "redis"), *failover)
            infra.redis_url, infra.versions["redis"] = redis["url"], redis.get("version", "?")
            infra.redis_sentinels = [s for s in redis.get("sentinels", "").split(",") if s]
            kafka = deploy_script("kafka.sh", "start", str(data_dir / "kafka"), "--brokers", str(kafka_brokers))
            infra.kafka_bootstrap, infra.versions["kafka"] = kafka["bootstrap"], kafka.get("version", "?")
        except BaseException:
            infra.stop()
            raise
        return infra

    def restart(self, name: str, kill: bool = True, down_s: float = 0.0, broker: int | None = None) -> None:
        """Stop ``kafka`` or ``redis`` (``kill``: SIGKILL, a crash), leave it down ``down_s`` seconds, and
        start it again with its data on the same address: clients see an outage, not a new server.
        ``broker``: that node of a Kafka cluster only."""
        deploy_script(f"{name}.sh", "restart", str(self._dir(name, broker)), *(["--kill"] if kill else []),
                env={"RESTART_DOWN_S": str(down_s)})

    def redis_settings(self) -> RedisSettings:
        """How a client reaches the current primary (through the Sentinels after a failover)."""
        return RedisSettings(url=self.redis_url, sentinels=self.redis_sentinels)

    def kill_redis_primary(self) -> None:
        """SIGKILL the Redis primary of a failover setup and leave it down: the Sentinels promote a replica."""
        if not self.redis_sentinels:
            raise ValueError("Redis runs without failover: there is no primary to lose")
        deploy_script("redis.sh", "kill", str(self.data_dir / "redis" / "primary"))

    def kill_broker(self, broker: int) -> None:
        """SIGKILL one node of the Kafka cluster and leave it down (:meth:`restart` brings it back)."""
        deploy_script("kafka.sh", "kill", str(self._dir("kafka", broker)))

    def _dir(self, name: str, broker: int | None) -> Path:
        if name not in ("kafka", "redis") or (broker is not None and name != "kafka"):
            raise ValueError(f"no infrastructure part named {name!r}" + (f" with broker {broker}" if broker else ""))
        return self.data_dir / name if broker is None else self.data_dir / name / f"broker-{broker}"

    def stop(self) -> None:
        for name in ("kafka", "redis"):
            if (self.data_dir / name).exists():
                try:
                    deploy_script(f"{name}.sh", "stop", str(self.data_dir / name), timeout_s=60)
                except (LaunchError, subprocess.TimeoutExpired) as exc:
                    _log.error("infra_stop_failed", what=name, error=str(exc))


@dataclass
class Service:
    """One rein service started as ``python -m <module>`` with its own environment."""

    name: str
    module: str
    env: dict[str, str]
    health_url: str | None
    log_path: Path
    new_session: bool = True
    """Own session: Ctrl-C in the terminal reaches only the parent, which stops children in order.
    Test services share pytest's process group, so a signal to the whole run reaches them too."""
    proc: Child | None = None

    def start(self) -> None:
        """``python -m module``: exec'd, or forked from this process's warm server with ``REIN_WARM_START=1``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = child_env({"PYTHONUNBUFFERED": "1", **self.env})
        if warm.enabled():
            try:
                server = warm.server(REPO, self.log_path.parent)
                self.proc = server.spawn(warm.Spec(("-m", self.module), env, str(REPO), str(self.log_path),
                                                  self.new_session))
            except RuntimeError as exc:
                raise LaunchError(f"{self.name}: {exc}") from exc
            return
        with self.log_path.open("ab") as handle:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module],
                cwd=REPO,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=self.new_session,
            )

    @property
    def process(self) -> Child:
        """The started process (an error before :meth:`start`)."""
        if self.proc is None:
            raise LaunchError(f"{self.name} was never started")
        return self.proc

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 60) -> str:
        return _tail(self.log_path, lines)

    def wait_healthy(self, timeout_s: float = 90, poll_s: float = 0.2) -> None:
        """Until ``GET health_url`` answers 200; LaunchError (with the log tail) if it exits or times out."""
        if self.health_url is None:
            return
        deadline = time.monotonic() + timeout_s
        last = "no attempt"
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise LaunchError(
                        f"{self.name} exited with {self.proc.returncode} before {self.health_url} was healthy; "
                        f"log {self.log_path}:\n{self.tail()}"
                    )
                try:
                    status = client.get(self.health_url).status_code
                    if status == 200:
                        return
                    last = f"status {status}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                time.sleep(poll_s)  # polling another process's HTTP endpoint: no event to wait on
        raise LaunchError(
            f"{self.name} not healthy at {self.health_url} after {timeout_s}s ({last}); "
            f"log {self.log_path}:\n{self.tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 20) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; idempotent. The exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_service(
    module: str, env: dict[str, str], health_url: str, timeout_s: float = 60, log_dir: Path | None = None
) -> Service:
    """Run ``python -m module`` and block until ``GET health_url`` answers 200.

    Raises :class:`LaunchError` (with the log tail) if the process exits or the deadline
    passes; the process is stopped first in both cases.
    """
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rein-proc-"))
    log_path = log_dir / f"{module.replace('.', '_')}-{os.getpid()}-{time.monotonic_ns()}.log"
    service = Service(module, module, env, health_url, log_path, new_session=False)
    service.start()
    try:
        service.wait_healthy(timeout_s, poll_s=0.1)
    except BaseException:
        service.stop()
        raise
    return service


@dataclass
class Stack:
    """Services started in order and stopped in reverse; a pid file lets ``rein down`` find them."""

    run_dir: Path
    services: list[Service] = field(default_factory=list)

    def add(self, service: Service, wait: bool = True, timeout_s: float = 90) -> Service:
        service.start()
        self.services.append(service)
        self._write_pids()
        if wait:
            service.wait_healthy(timeout_s)
        return service

    def dead(self) -> list[Service]:
        return [s for s in self.services if not s.alive()]

    def stop(self, timeout_s: float = 20) -> None:
        """SIGTERM every service (newest first), wait for all under one deadline, then SIGKILL the rest.

        One shared deadline keeps Ctrl-C quick: a slow drain in one service does not
        add to the next one's.
        """
        running = [s for s in reversed(self.services) if s.alive()]
        for service in running:
            assert service.proc is not None
            service.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for service in running:
            assert service.proc is not None
            try:
                service.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _log.warning("service_killed", service=service.name, after_s=timeout_s)
                service.proc.kill()
                service.proc.wait(timeout=10)
        self._write_pids()

    def _write_pids(self) -> None:
        pids = {s.name: s.proc.pid for s in self.services if s.proc is not None and s.proc.poll() is None}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2))


def stop_recorded(run_dir: Path, timeout_s: float = 20) -> list[str]:
    """Stop the services recorded in ``run_dir/pids.json`` (TERM, bounded wait, KILL), then its infra.

    For ``rein down``: the processes were started by another command that has exited.
    Returns the names of the services that were still running.
    """
    stopped: list[str] = []
    pid_file = run_dir / "pids.json"
    pids: dict[str, int] = json.loads(pid_file.read_text()) if pid_file.exists() else {}
    for name, pid in reversed(list(pids.items())):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        stopped.append(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if pid_file.exists():
        pid_file.write_text("{}")
    Infra(run_dir / "infra").stop()
    return stopped
