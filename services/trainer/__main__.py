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
from shared.stopping import exit_after


def main() -> None:
    settings = load(TrainerSettings)
    logger = log.configure("trainer", settings.log_level, settings.log_json)
    stop = threading.Event()

    def stopping(*_: object) -> None:
        # The step in progress ends; a wait on a dead broker is cut at the bound. A step is durable only once its
        # sidecar line is written (the commit point), so a cut loses at most that step, trained again on restart.
        stop.set()
        exit_after(settings.stop_timeout_s, "trainer")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopping)
    ranks = join(resolve_device(settings.device).type)  # torchrun: data-parallel ranks (services/trainer/parallel.py)
    try:
        result = run(settings, stop, ranks)
    finally:
        leave(ranks)
    logger.info("trainer_stopped", start_step=result.start_step, step=result.step, trained=len(result.trained_indices),
                rank=ranks.rank, world=ranks.world)


if __name__ == "__main__":
    main()
