"""A bound on a stop: once it is spent, the process exits even if a wait is still running.

Every service but the engine holds nothing that Kafka, Redis or its own durable files cannot rebuild (a pause
the broadcaster leaves behind is a lease that expires; a trainer step is durable only once its sidecar line is
written, so a cut loses at most that step, trained again on restart), so an exit in the middle of a wait loses
nothing a crash would not (and each is tested against SIGKILL). Without a bound, one blocking call on a dead
broker (a commit or an ack wait of ``request_timeout_ms``, 30 s) keeps a stopping service up past compose's
grace period (tests/e2e/test_stop_bounded.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from shared import log

_log = log.get(__name__)
_armed = threading.Lock()


def exit_after(seconds: float, service: str) -> None:
    """Arm (once per process) a timer that ends the process with status 0 ``seconds`` from now."""
    if not _armed.acquire(blocking=False):
        return
    started = time.monotonic()

    def expire() -> None:
        _log.warning("stop_forced", service=service, after_s=round(time.monotonic() - started, 1),
                     note="a wait on a dependency outlived stop_timeout_s; what was in flight is read again "
                          "or retried, as after a crash")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
