"""The balancer keeps a session on the replica that answered its first call, even when the replica its
key hashes to was counted up before it listened (deploy/haproxy/rein.cfg.in).

HAProxy 2.6 counts a replica up as soon as it appears (DNS names it, or it leaves maintenance), before
its first health check: a session's first call can hash to it while nothing listens there. Such a
call is redispatched to a replica that answers, and the stick table must then remember that one, not
the replica first chosen: once the newcomer listens, the session's next calls would reach it, and a
session served by two proxies is lost (the collector rejects it, ``conflicting_chunks``). The test
holds the newcomer in that state with HAProxy's runtime API (health checks off, health forced up),
so the window of a fraction of a second is as long as the test needs.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from ops.local.launcher import deploy_script
from ops.local.ports import free_ports

SESSIONS = 24


class _Named(BaseHTTPRequestHandler):
    """Answers every call with the name of its server."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps({"server": self.server.name}).encode()  # type: ignore[attr-defined]
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except ConnectionError:  # a health check that hung up once it had the status line
            pass

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(name: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Named)
    server.name = name  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _admin(sock: Path, command: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(command.encode() + b"\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def _stat(sock: Path, server: str, field: str) -> str:
    lines = _admin(sock, "show stat").splitlines()
    header = lines[0].lstrip("# ").split(",")
    row = next(line.split(",") for line in lines[1:] if line.startswith(f"proxies,{server},"))
    return row[header.index(field)]


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[tuple[str, Path, int]]:
    deploy_script("haproxy.sh", "install", timeout_s=900)
    old_port, new_port = free_ports(2)
    old = _serve("old", old_port)
    started = deploy_script("haproxy.sh", "start", str(tmp_path), f"127.0.0.1:{old_port}", f"127.0.0.1:{new_port}")
    try:
        yield started["url"], Path(started["admin"]), new_port
    finally:
        deploy_script("haproxy.sh", "stop", str(tmp_path), timeout_s=30)
        old.shutdown()
        old.server_close()


def test_a_session_stays_on_the_replica_that_answered_its_first_call(balancer: tuple[str, Path, int]) -> None:
    url, admin, new_port = balancer
    # The newcomer (server p1) counted up with nothing listening, and kept so.
    assert _admin(admin, "disable health proxies/p1").strip() == ""
    assert _admin(admin, "set server proxies/p1 health up").strip() == ""
    assert _stat(admin, "p1", "status") == "no check", "unchecked, so counted up"

    def call(session: str) -> str:
        answer = httpx.post(f"{url}/v1/chat/completions", json={}, headers={"X-Session-Id": session}, timeout=10)
        assert answer.status_code == 200, (session, answer.status_code, answer.text[:200])
        served: str = answer.json()["server"]
        return served

    first = {f"s-{i}": call(f"s-{i}") for i in range(SESSIONS)}
    assert set(first.values()) == {"old"}, "nothing listens on the newcomer yet"
    redispatched = int(_stat(admin, "p1", "wredis"))
    assert redispatched > 0, f"none of {SESSIONS} sessions hashed to the newcomer: the test checked nothing"

    new = _serve("new", new_port)
    try:
        assert _admin(admin, "enable health proxies/p1").strip() == ""
        later = {s: call(s) for s in first}
        assert later == first, f"sessions moved to the newcomer once it listened: {later}"
        fresh = {f"t-{i}": call(f"t-{i}") for i in range(SESSIONS)}
        assert "new" in fresh.values(), "the newcomer takes new sessions"
        assert {s: call(s) for s in fresh} == fresh, "and keeps them"
    finally:
        new.shutdown()
        new.server_close()
