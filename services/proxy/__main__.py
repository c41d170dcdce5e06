"""``python -m services.proxy``: read settings, configure logging, serve."""

from __future__ import annotations

import uvicorn

from services.proxy.app import create_app
from services.proxy.settings import ProxySettings
from shared import log
from shared.http_server import KEEP_ALIVE_S
from shared.settings import load


def main() -> None:
    settings = load(ProxySettings)
    log.configure("proxy", settings.log_level, settings.log_json)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False, timeout_keep_alive=KEEP_ALIVE_S, proxy_headers=False,  # no client address is read
                timeout_graceful_shutdown=settings.shutdown_timeout_s)


if __name__ == "__main__":
    main()
