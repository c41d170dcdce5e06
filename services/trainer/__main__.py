"""``python -m services.trainer``: read settings, configure logging, train until max_steps or SIGTERM."""

from __future__ import annotations

import signal
import threading

from services.trainer.loop import run
from services.trainer.settings import TrainerSettings
from shared import log
from shared.settings import load


def main() -> None:
    settings = load(TrainerSettings)
    logger = log.configure("trainer", settings.log_level, settings.log_json)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    result = run(settings, stop)
    logger.info("trainer_stopped", start_step=result.start_step, step=result.step, trained=len(result.trained_indices))


if __name__ == "__main__":
    main()
