"""The compose file's health probes, run as Docker runs them, against real servers.

docker-compose.yml checks health in bash (``/dev/tcp``) rather than starting python or a JVM per check.
Each probe is taken from the compose file, interpolated as compose does (``$$`` to ``$``), and must
succeed against a server that is up and fail against one that is not, within its bound.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
import yaml
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from ops.local.ports import free_port
from shared.status_server import StatusServer
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _test(service: str) -> list[str]:
    """The healthcheck's command as the container runs it (``CMD`` dropped, ``$$`` interpolated)."""
    test = yaml.safe_load(COMPOSE.read_text())["services"][service]["healthcheck"]["test"]
    assert test[0] == "CMD", test
    return [arg.replace("$$", "$") for arg in test[1:]]


def _probe(service: str, host_port: str) -> int:
    """Run ``service``'s probe with its address replaced by ``host_port``; the exit status."""
    cmd = _test(service)
    if service == "kafka":
        assert "/dev/tcp/127.0.0.1/9092" in cmd[2], cmd
        cmd[2] = cmd[2].replace("/dev/tcp/127.0.0.1/9092", "/dev/tcp/" + host_port.replace(":", "/"))
    else:
        cmd[-1] = f"http://{host_port}/health"
    return subprocess.run(cmd, capture_output=True, timeout=15).returncode


def _closed_port() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def fastapi_port() -> Iterator[int]:
    """A FastAPI app on uvicorn, as the engine and the proxy serve ``/health``."""
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10, "uvicorn to listen")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_broker_probe_passes_on_a_broker_and_fails_without_one(kafka_bootstrap: str) -> None:
    assert _probe("kafka", kafka_bootstrap.split(",")[0]) == 0
    assert _probe("kafka", _closed_port()) != 0


@pytest.mark.parametrize("healthy", [True, False])
def test_the_http_probe_follows_the_status_servers_health(healthy: bool) -> None:
    server = StatusServer("127.0.0.1", 0, CollectorRegistry(), lambda: (healthy, {})).start()
    try:
        assert (_probe("trainer", f"127.0.0.1:{server.port}") == 0) is healthy
    finally:
        server.stop()


def test_the_http_probe_passes_on_the_apps_server_and_fails_on_a_closed_port(fastapi_port: int) -> None:
    for service in ("engine", "proxy"):
        assert _probe(service, f"127.0.0.1:{fastapi_port}") == 0, service
    assert _probe("proxy", _closed_port()) != 0
