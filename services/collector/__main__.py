"""``python -m services.collector``: read settings, configure logging, run one replica until SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import threading

from services.collector.service import Collector
from services.collector.settings import CollectorSettings
from shared import log
from shared.settings import load
from shared.stopping import exit_after


def main() -> None:
    settings = load(CollectorSettings)
    log.configure("collector", settings.log_level, settings.log_json)
    stop = threading.Event()

    def stopping(*_: object) -> None:
        stop.set()  # the loop ends after its iteration; one stuck on a dead broker is cut at the bound
        exit_after(settings.stop_timeout_s, "collector")

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    Collector(settings, stop).run()


if __name__ == "__main__":
    main()
