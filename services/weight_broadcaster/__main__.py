"""``python -m services.weight_broadcaster``: read settings, configure logging, broadcast until SIGTERM."""

from __future__ import annotations

import signal
import threading

from services.weight_broadcaster.loop import run
from services.weight_broadcaster.settings import BroadcasterSettings
from shared import log
from shared.settings import load


def main() -> None:
    settings = load(BroadcasterSettings)
    log.configure("weight_broadcaster", settings.log_level, settings.log_json)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(settings, stop)


if __name__ == "__main__":
    main()
