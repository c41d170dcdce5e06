"""A proxy replica joining the others: join the pause in progress, then register (:mod:`shared.membership`).

At start, before the proxy serves anything, it joins a pause the broadcaster holds (it may be one of
several replicas behind a load balancer, started in the middle of a weight update) and registers, so
no proxy ever serves generations while the engines change weights.
"""

from __future__ import annotations

import asyncio

import redis

from services.proxy.service import ProxyService
from services.proxy.settings import ProxySettings
from shared import log
from shared.membership import Members, Registration
from shared.names import RedisKeys
from shared.pause_record import PauseRecord

_log = log.get(__name__)


class Joining:
    """A started proxy's hold on its place among the replicas: its registration, renewed until :meth:`stop`."""

    def __init__(self, registration: Registration, pauses: PauseRecord) -> None:
        self.registration = registration
        self.pauses = pauses

    @classmethod
    async def start(cls, settings: ProxySettings, service: ProxyService, client: redis.Redis) -> Joining:
        """Join a held pause, register, and start renewing (Redis unreachable: ``StateUnavailable``).
        ``client`` is the proxy's (it closes it)."""
        keys = RedisKeys(settings.redis.key_prefix)
        self = cls(Registration(Members(client, keys, "proxy"), settings), PauseRecord(client, keys))
        held = await asyncio.to_thread(self.pauses.current)
        if held is not None:
            await service.pause(held.reason, None, held.pause_id, held.lease_left_s)
            _log.info("proxy_joined_pause", pause_id=held.pause_id, lease_left_s=round(held.lease_left_s, 2))
        await self.registration.start()
        return self

    async def stop(self) -> None:
        """Stop renewing and leave, so the broadcaster stops pausing this proxy at once."""
        await self.registration.stop()
