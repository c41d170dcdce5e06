"""``python -m services.rollout``: read settings, run the runner until done or signalled."""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop

from services.rollout.runner import Runner
from services.rollout.settings import RolloutSettings
from shared import log
from shared.settings import load
from shared.stopping import exit_after


async def _main(runner: Runner) -> None:
    loop = asyncio.get_running_loop()

    def stopping() -> None:
        runner.stop()
        exit_after(runner.settings.stop_timeout_s, "rollout")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping)
    await runner.run()


def main() -> None:
    settings = load(RolloutSettings)
    logger = log.configure("rollout", settings.log_level, settings.log_json)
    try:
        uvloop.run(_main(Runner(settings)))  # libuv: cheaper per HTTP call than asyncio's default loop
    except Exception as exc:  # the one place a fatal error becomes a clear message and exit code 1
        logger.error("rollout_failed", error=f"{type(exc).__name__}: {exc}")
        sys.exit(1)


if __name__ == "__main__":
    main()
