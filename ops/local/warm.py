"""Services forked from a warm interpreter: the services' modules (torch among them) imported once.

Importing a service is most of the CPU its start takes: 2.4 CPU-s for the engine (torch 1.5 of it), 2.1 for
the trainer, about 0.5 for the others, paid again by every process, and the test suite starts some 180
(docs/development.md). A warm server (``python -m ops.local.warm``) imports every service once, then forks a
child per request; the child takes the service's environment, working directory, log and session and runs
what ``python ARGS`` would (``-m module`` or a script) as ``__main__``. The launcher (:mod:`ops.local.launcher`)
uses it when ``REIN_WARM_START=1`` (the test suite sets it, for services and bench scripts); ``make demo`` and
``rein up`` exec each service, so that ``ps`` shows its command line (a warm child shows the server's, and its
service's name as the process name).

One line of JSON each way on the server's stdin and stdout: a request ``{"args", "env", "cwd", "log",
"new_session"}`` is answered ``{"started": pid}`` (or ``{"error": ...}``), and every child's end is reported as
``{"exited": pid, "returncode": rc}`` (``-N`` for a signal, as :class:`subprocess.Popen` has it) once the
server has reaped it; its ``started`` line always comes first. The server exits when its stdin closes, leaving
its children running. The import starts one thread, OpenBLAS's pool (numpy's), which stops itself around a
fork (``pthread_atfork``); the server refuses to serve with any Python thread besides its own. What a library
reads from the environment when it is imported (``OMP_NUM_THREADS``, ``HF_HUB_OFFLINE``) has the server's
value in every child: services take their settings from ``REIN_*`` variables, read when they start.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shared.settings import child_env

ENV_FLAG = "REIN_WARM_START"
"""``1``: the launcher forks services from a warm server instead of exec'ing each (read by the launcher only)."""
UNKNOWN = -255
"""The return code of a child that ended after its server was gone (nobody left who reaped it knows its status)."""

SERVICES = ("engine", "trainer", "proxy", "collector", "rollout", "weight_broadcaster")
"""Imported by the server before it serves: what ``python -m services.<name>`` imports."""


@dataclass(frozen=True)
class Spec:
    """What a child becomes: ``python *args`` (``-m module ...`` or ``script.py ...``) in ``cwd`` with exactly
    ``env``, its output appended to ``log``."""

    args: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    log: str
    new_session: bool

    @classmethod
    def parse(cls, line: bytes) -> Spec:
        raw = json.loads(line)
        spec = cls(tuple(str(a) for a in raw["args"]), {str(k): str(v) for k, v in raw["env"].items()},
                   str(raw["cwd"]), str(raw["log"]), bool(raw["new_session"]))
        if not spec.log or not spec.args or (spec.args[0] == "-m" and len(spec.args) < 2):
            raise ValueError("a request needs a log path and a module (-m name) or a script")
        return spec

    @property
    def module(self) -> str | None:
        return self.args[1] if self.args[0] == "-m" else None

    @property
    def name(self) -> str:
        """The module's last part or the script's stem: the child's process name."""
        return self.module.rsplit(".", 1)[-1] if self.module else Path(self.args[0]).stem

    def run(self) -> None:
        """In the child, once it is set up: run it as ``__main__`` (returns when it ends without ``sys.exit``)."""
        if self.module:
            sys.argv = [self.module, *self.args[2:]]  # runpy puts the module's file in sys.argv[0]
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)
        else:
            script = str(Path(self.args[0]).resolve())
            sys.argv = list(self.args)
            sys.path[0] = str(Path(script).parent)  # as for `python script.py`
            runpy.run_path(script, run_name="__main__")


def preload() -> None:
    """Import every service's ``__main__`` for its imports, then forget the modules themselves so that each child
    runs its own fresh (runpy warns about a ``__main__`` found already imported), and freeze what is left so
    that a child's garbage collector never touches, and so copies, the server's pages."""
    for name in SERVICES:
        __import__(f"services.{name}.__main__")
        del sys.modules[f"services.{name}.__main__"]
    gc.collect()
    gc.freeze()


def _send(message: dict[str, object]) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _become(spec: Spec, wakeup: tuple[int, int]) -> None:
    """In the forked child: the service's session, output, environment and directory; never returns on failure."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup:
            os.close(fd)
        if spec.new_session:
            os.setsid()
        log = os.open(spec.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the server's request pipe and answer pipe (0 and 1) are closed in the child by these
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(spec.env)
        os.chdir(spec.cwd)
        with contextlib.suppress(OSError):  # `ps` and `top` show the service's name (the command line: the server's)
            Path("/proc/self/comm").write_text(spec.name[:15])
    except BaseException:
        traceback.print_exc()
        os._exit(127)


def serve() -> Spec:
    """Answer requests until stdin closes (then exit); returns only in a forked child, with what it is to run."""
    if threading.active_count() != 1:
        raise SystemExit(f"warm server: {threading.active_count()} Python threads after the imports; forking is unsafe")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)  # a handler, so that SIGCHLD writes the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the launcher, which stops the children in order
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    _send({"ready": True})
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _reap()
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                raise SystemExit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    spec = Spec.parse(line)
                    pid = os.fork()
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                    _send({"error": f"{type(exc).__name__}: {exc}"})
                    continue
                if pid == 0:
                    selector.close()
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    _become(spec, (wake_r, wake_w))
                    return spec
                _send({"started": pid})
            _reap()


def enabled() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


class Server:
    """The launcher's side: one warm server per launching process, started on first use, gone when it exits."""

    def __init__(self, repo: Path, env: dict[str, str], log: Path, ready_timeout_s: float = 120) -> None:
        self.log = log
        self._requests = threading.Lock()
        self._answers: list[dict[str, object]] = []
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._ready = False
        self._gone = False
        with log.open("ab") as handle:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__], cwd=repo, env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=handle)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        threading.Thread(target=self._read, args=(self._proc.stdout,), name="warm-server", daemon=True).start()
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or self._gone, ready_timeout_s) or not self._ready:
                self.close()
                raise RuntimeError(f"the warm server did not start within {ready_timeout_s}s; log {log}:\n{_tail(log)}")

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exits[int(message["exited"])] = int(message["returncode"])
                elif "ready" in message:
                    self._ready = True
                else:
                    self._answers.append(message)
                self._changed.notify_all()
        stdout.close()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    @property
    def alive(self) -> bool:
        return not self._gone

    def spawn(self, spec: Spec, timeout_s: float = 30) -> Child:
        request = json.dumps({"args": spec.args, "env": spec.env, "cwd": spec.cwd, "log": spec.log,
                              "new_session": spec.new_session}).encode() + b"\n"
        with self._requests:  # one request at a time: the next answer is this one's
            try:
                self._stdin.write(request)
                self._stdin.flush()
            except OSError as exc:
                raise RuntimeError(f"the warm server is gone ({exc}); log {self.log}:\n{_tail(self.log)}") from exc
            with self._changed:
                self._changed.wait_for(lambda: bool(self._answers) or self._gone, timeout_s)
                if not self._answers:
                    raise RuntimeError(f"no answer from the warm server for {spec.name} in {timeout_s}s; {self.log}")
                answer = self._answers.pop(0)
        if "error" in answer:
            raise RuntimeError(f"the warm server could not start {spec.name}: {answer['error']}")
        return Child(self, int(str(answer["started"])))

    def returncode(self, pid: int) -> int | None:
        """The child's return code once it has ended; after the server is gone, :data:`UNKNOWN` once it has."""
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if not self._gone:
                return None
        return None if _running(pid) else UNKNOWN

    def wait_exit(self, pid: int, timeout_s: float | None) -> int | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            code = self.returncode(pid)
            left = None if deadline is None else deadline - time.monotonic()
            if code is not None or (left is not None and left <= 0):
                return code
            with self._changed:  # the server reports each exit; once it is gone, look again every 0.1 s
                self._changed.wait(0.1 if self._gone else left)

    def close(self) -> None:
        """Close the server's stdin: it exits, its children run on."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


class Child:
    """A service forked by a warm server, with what the launcher and the tests use of :class:`subprocess.Popen`."""

    def __init__(self, server: Server, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.wait_exit(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"python -m {__name__} child {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal it unless it has been seen to end (its PID may be another process's by then)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


_server: Server | None = None
_server_lock = threading.Lock()


def server(repo: Path, log_dir: Path) -> Server:
    """This process's warm server, started if none is alive (its log in ``log_dir``; its environment this
    process's minus ``REIN_*``, as a service's: what its children inherit is replaced by each request's)."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            log_dir.mkdir(parents=True, exist_ok=True)
            env = child_env({"PYTHONUNBUFFERED": "1"})
            _server = Server(repo, env, log_dir / f"warm-server-{os.getpid()}.log")
            atexit.register(_server.close)
        return _server


def main() -> None:
    preload()
    spec = serve()
    spec.run()


if __name__ == "__main__":
    main()
