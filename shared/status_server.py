"""The one ``/metrics`` + ``/health`` server of the services without an HTTP API of their own.

Collector, trainer, broadcaster and rollout runner serve their registry and a health callback
from a daemon thread, so a busy or blocked main loop (synchronous or asyncio) still answers.
Engine and proxy serve the same two routes from their own FastAPI apps.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry

from shared import metrics

HealthFn = Callable[[], tuple[bool, dict[str, object]]]


class StatusServer:
    """Serves the registry and a health callback from a daemon thread; ``port`` is the bound port."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: HealthFn) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] == "/metrics":
                    body, ctype = metrics.render(registry)
                    self._send(200, body, ctype)
                elif self.path.split("?")[0] == "/health":
                    ok, detail = health()
                    self._send(200 if ok else 503, json.dumps(detail).encode(), "application/json")
                else:
                    self._send(404, b'{"detail": "not found"}', "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-http", daemon=True)

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
