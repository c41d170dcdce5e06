"""A proxy replica's registration: join the pause in progress, then keep its registration alive.

The I/O around :mod:`shared.members` (Redis calls run in a thread: the client is synchronous). At
start, before the proxy serves anything, it joins a pause the broadcaster holds (it may be one of
several replicas behind a load balancer, started in the middle of a weight update) and registers;
then it renews the registration every ``heartbeat_s`` and leaves on shutdown. A Redis outage after
start is logged and retried: the registration lapses after ``registration_ttl_s`` and comes back
with Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from services.proxy.service import ProxyService
from services.proxy.settings import ProxySettings
from shared import log
from shared.members import Members, PauseRecord
from shared.names import RedisKeys
from shared.outage import DEPENDENCY_ERRORS
from shared.state import connect

_log = log.get(__name__)


def advertised(template: str) -> str:
    """``REIN_ADVERTISE_URL`` with ``{ip}`` replaced by the address this host's name resolves to."""
    return template.replace("{ip}", socket.gethostbyname(socket.gethostname())) if "{ip}" in template else template


class Membership:
    def __init__(self, settings: ProxySettings, members: Members, pauses: PauseRecord) -> None:
        self.settings = settings
        self.url = advertised(settings.advertise_url)
        self.members = members
        self.pauses = pauses
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, settings: ProxySettings, service: ProxyService) -> Membership:
        """Join a held pause, register, and start renewing (Redis unreachable: ``StateUnavailable``)."""
        client = await asyncio.to_thread(connect, settings.redis)
        keys = RedisKeys(settings.redis.key_prefix)
        self = cls(settings, Members(client, keys), PauseRecord(client, keys))
        try:
            held = await asyncio.to_thread(self.pauses.current)
            if held is not None:
                await service.pause(held.reason, None, held.pause_id, held.lease_left_s)
                _log.info("proxy_joined_pause", pause_id=held.pause_id, lease_left_s=round(held.lease_left_s, 2))
            await asyncio.to_thread(self.members.beat, self.url, settings.registration_ttl_s)
        except BaseException:
            client.close()
            raise
        _log.info("proxy_registered", url=self.url, ttl_s=settings.registration_ttl_s)
        self._task = asyncio.create_task(self._renew())
        return self

    async def _renew(self) -> None:
        s = self.settings
        while True:
            await asyncio.sleep(s.heartbeat_s)
            try:
                await asyncio.to_thread(self.members.beat, self.url, s.registration_ttl_s)
            except DEPENDENCY_ERRORS as exc:
                _log.warning("proxy_registration_not_renewed", url=self.url, error=str(exc))

    async def stop(self) -> None:
        """Stop renewing and leave, so the broadcaster stops pausing this proxy at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await asyncio.to_thread(self.members.leave, self.url)
        except DEPENDENCY_ERRORS as exc:
            _log.warning("proxy_leave_failed", url=self.url, error=str(exc))
        self.members.client.close()
