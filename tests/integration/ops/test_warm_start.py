"""Services forked from the warm server (``ops/local/warm.py``) see what ``python -m`` would give them, and
end, signal and report as :class:`subprocess.Popen` children do; the launcher's exec path still starts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.local import warm
from ops.local.launcher import REPO, Service
from shared.settings import child_env
from tests.support.wait import wait_until

PROBE = "tests.support.warm_probe"


def _server(log: Path) -> warm.Server:
    return warm.Server(REPO, child_env({"PYTHONUNBUFFERED": "1", "REIN_SERVER_ONLY": "x"}), log)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[warm.Server]:
    """One server for the tests that leave it serving (its start imports every service: 2-3 CPU-s)."""
    srv = _server(tmp_path_factory.mktemp("warm") / "server.log")
    yield srv
    srv.close()


def _seen(log: Path) -> dict[str, object]:
    wait_until(lambda: log.exists() and log.read_text().strip() != "", 30, "the probe wrote nothing")
    seen: dict[str, object] = json.loads(log.read_text().splitlines()[0])
    return seen


def _spec(tmp_path: Path, name: str, env: dict[str, str], new_session: bool = True) -> warm.Spec:
    return warm.Spec(("-m", PROBE), env, str(tmp_path), str(tmp_path / f"{name}.log"), new_session)


def test_a_child_sees_exactly_its_environment_directory_log_and_session(server: warm.Server, tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "PROBE_EXIT": "3", "REIN_MODEL": "tiny"}
    child = server.spawn(_spec(tmp_path, "own", env))
    assert child.wait(30) == 3
    seen = _seen(tmp_path / "own.log")
    assert seen["env"] == env, "the server's variables leaked into the child, or its own were lost"
    assert (seen["name"], seen["cwd"], seen["stdin"]) == ("__main__", str(tmp_path), "")
    argv = seen["argv"]
    assert isinstance(argv, list) and str(argv[0]).endswith("tests/support/warm_probe.py") and len(argv) == 1
    assert seen["sid"] == child.pid and seen["pgid"] == child.pid, "new_session: a session of its own"
    assert seen["comm"] == "warm_probe"

    shared = server.spawn(_spec(tmp_path, "shared", env, new_session=False))
    assert shared.wait(30) == 3
    assert _seen(tmp_path / "shared.log")["pgid"] == os.getpgid(0), "without new_session: the launcher's group"


def test_a_script_runs_as_python_script_py_would(server: warm.Server, tmp_path: Path) -> None:
    script = REPO / "tests" / "support" / "warm_probe.py"
    child = server.spawn(warm.Spec((str(script.relative_to(REPO)), "--flag", "x"), {"PATH": os.environ["PATH"]},
                                   str(REPO), str(tmp_path / "script.log"), True))
    assert child.wait(30) == 0
    seen = _seen(tmp_path / "script.log")
    assert (seen["name"], seen["argv"], seen["path0"]) == ("__main__", [str(script), "--flag", "x"], str(script.parent))
    assert seen["comm"] == "warm_probe"


def test_signals_and_waits_answer_as_popen_does(server: warm.Server, tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "PROBE_EXIT": "wait"}
    term, kill = (server.spawn(_spec(tmp_path, n, env)) for n in ("term", "kill"))
    _seen(tmp_path / "term.log")
    with pytest.raises(subprocess.TimeoutExpired):
        term.wait(0.2)
    assert term.poll() is None
    term.terminate()
    kill.kill()
    assert (term.wait(30), kill.wait(30)) == (-signal.SIGTERM, -signal.SIGKILL)
    term.kill()  # ended and seen: a no-op, not a signal to whoever has its PID now
    assert term.returncode == -signal.SIGTERM


def test_a_bad_request_is_refused_and_the_server_serves_on(server: warm.Server, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="could not start"):
        server.spawn(warm.Spec(("-m", PROBE), {}, str(tmp_path), "", True))  # no log path
    ok = server.spawn(_spec(tmp_path, "ok", {"PATH": os.environ["PATH"]}))
    assert ok.wait(30) == 0


def test_children_outlive_a_dead_server_and_end_unknown(tmp_path: Path) -> None:
    server = _server(tmp_path / "server.log")
    child = server.spawn(_spec(tmp_path, "orphan", {"PATH": os.environ["PATH"], "PROBE_EXIT": "wait"}))
    _seen(tmp_path / "orphan.log")
    server._proc.kill()
    wait_until(lambda: not server.alive, 30, "the launcher did not see its server go")
    assert child.poll() is None, "the child ended with its server"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == warm.UNKNOWN
    server.close()


@pytest.mark.parametrize("warm_start", ["1", "0"])
def test_the_launcher_starts_a_service_warm_or_exec(warm_start: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(warm.ENV_FLAG, warm_start)
    service = Service("probe", PROBE, {"PROBE_EXIT": "wait"}, None, tmp_path / "probe.log")
    service.start()
    try:
        seen = _seen(tmp_path / "probe.log")
        cmdline = Path(f"/proc/{service.pid}/cmdline").read_text()
        assert ("-m\0ops.local.warm" in cmdline) == (warm_start == "1"), cmdline
        env = seen["env"]
        assert isinstance(env, dict) and env.get("PYTHONUNBUFFERED") == "1" and warm.ENV_FLAG not in env
        assert service.alive()
    finally:
        assert service.stop(timeout_s=30) == -signal.SIGTERM
    assert not service.alive()

