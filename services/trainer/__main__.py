"""``python -m services.trainer``: read settings, configure logging, train until max_steps or SIGTERM.

``torchrun --nproc-per-node N -m services.trainer`` trains data-parallel on N ranks (rank 0 leads).
"""

from __future__ import annotations

import signal
import threading

from services.trainer.loop import run
from services.trainer.parallel import join, leave
from services.trainer.settings import TrainerSettings
from shared import log
from shared.policy import resolve_device
from shared.settings import load


def main() -> None:
    settings = load(TrainerSettings)
    logger = log.configure("trainer", settings.log_level, settings.log_json)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ranks = join(resolve_device(settings.device).type)  # torchrun: data-parallel ranks (services/trainer/parallel.py)
    try:
        result = run(settings, stop, ranks)
    finally:
        leave(ranks)
    logger.info("trainer_stopped", start_step=result.start_step, step=result.step, trained=len(result.trained_indices),
                rank=ranks.rank, world=ranks.world)


if __name__ == "__main__":
    main()
