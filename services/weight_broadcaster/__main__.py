"""``python -m services.weight_broadcaster``: read settings, configure logging, broadcast until SIGTERM."""

from __future__ import annotations

import signal
import threading

from services.weight_broadcaster.service import run
from services.weight_broadcaster.settings import BroadcasterSettings
from shared import log
from shared.settings import load
from shared.stopping import exit_after


def main() -> None:
    settings = load(BroadcasterSettings)
    log.configure("weight_broadcaster", settings.log_level, settings.log_json)
    stop = threading.Event()

    def stopping(*_: object) -> None:
        stop.set()  # a round in progress ends (a paused proxy is resumed); a wait on a dead broker is cut
        exit_after(settings.stop_timeout_s, "weight_broadcaster")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopping)
    run(settings, stop)


if __name__ == "__main__":
    main()
