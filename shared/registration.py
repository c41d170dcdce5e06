"""A replica's registration in Redis, kept alive from an asyncio service (the proxy, the engine).

The I/O around :class:`shared.members.Members` (its Redis calls run in a thread: the client is
synchronous): register once at start (Redis unreachable: the service does not start, since nobody could
find it), renew every ``heartbeat_s``, leave on shutdown. A Redis outage after start is logged and
retried: the registration lapses after ``registration_ttl_s`` and comes back with Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from shared import log
from shared.members import Members
from shared.outage import DEPENDENCY_ERRORS
from shared.settings import ReplicaSettings

_log = log.get(__name__)


def advertised(template: str) -> str:
    """``REIN_ADVERTISE_URL`` with ``{ip}`` replaced by the address this host's name resolves to."""
    return template.replace("{ip}", socket.gethostbyname(socket.gethostname())) if "{ip}" in template else template


class Registration:
    def __init__(self, members: Members, settings: ReplicaSettings, kind: str) -> None:
        self.members = members
        self.settings = settings
        self.kind = kind
        self.url = advertised(settings.advertise_url)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register (raises what Redis raised) and start renewing."""
        await asyncio.to_thread(self.members.beat, self.url, self.settings.registration_ttl_s)
        _log.info("registered", kind=self.kind, url=self.url, ttl_s=self.settings.registration_ttl_s)
        self._task = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        s = self.settings
        while True:
            await asyncio.sleep(s.heartbeat_s)
            try:
                await asyncio.to_thread(self.members.beat, self.url, s.registration_ttl_s)
            except DEPENDENCY_ERRORS as exc:
                _log.warning("registration_not_renewed", kind=self.kind, url=self.url, error=str(exc))

    async def stop(self) -> None:
        """Stop renewing and leave, so the others stop using this replica at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await asyncio.to_thread(self.members.leave, self.url)
        except DEPENDENCY_ERRORS as exc:
            _log.warning("leave_failed", kind=self.kind, url=self.url, error=str(exc))
