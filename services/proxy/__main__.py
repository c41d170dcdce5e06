"""``python -m services.proxy``: read settings, configure logging, serve."""

from __future__ import annotations

from types import FrameType

import uvicorn

from services.proxy.app import create_app
from services.proxy.settings import ProxySettings
from shared import log
from shared.http_server import KEEP_ALIVE_S
from shared.settings import load
from shared.stopping import exit_after


class _Server(uvicorn.Server):
    """uvicorn's server with the stop's bound armed by the first SIGTERM/SIGINT."""

    def __init__(self, config: uvicorn.Config, stop_timeout_s: float) -> None:
        super().__init__(config)
        self.stop_timeout_s = stop_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        exit_after(self.stop_timeout_s, "proxy")
        super().handle_exit(sig, frame)


def main() -> None:
    settings = load(ProxySettings)
    log.configure("proxy", settings.log_level, settings.log_json)
    # Calls in flight get half the stop's bound (then they are cancelled: held by a pause whose resume never
    # comes, or waiting on a dead broker's acks); closing the publisher and the engine clients gets the rest.
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                            proxy_headers=False,  # no client address is read
                            timeout_graceful_shutdown=max(1, int(settings.stop_timeout_s / 2)))
    _Server(config, settings.stop_timeout_s).run()


if __name__ == "__main__":
    main()
