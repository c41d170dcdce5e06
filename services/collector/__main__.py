"""``python -m services.collector``: read settings, configure logging, run one replica until SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import threading

from services.collector.service import Collector
from services.collector.settings import CollectorSettings
from shared import log
from shared.settings import load


def main() -> None:
    settings = load(CollectorSettings)
    log.configure("collector", settings.log_level, settings.log_json)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    Collector(settings, stop).run()


if __name__ == "__main__":
    main()
