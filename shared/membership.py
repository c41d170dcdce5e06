"""Who is alive: replicas of each kind (``proxy``, ``engine``) that register themselves in Redis.

A replica started with ``REIN_ADVERTISE_URL`` registers at start and renews every ``heartbeat_s``; the
registration expires by itself ``registration_ttl_s`` after the last renewal, so a reader's list (the
broadcaster's proxies to pause and engines to update, the proxy's engines to route to) is always the live
replicas, without a configured list (``REIN_PROXY_URLS`` and ``REIN_ENGINE_URLS`` still add fixed ones).

:class:`Members` is the Redis side (synchronous, like the client); :class:`Registration` keeps one
replica's registration alive from an asyncio service, its Redis calls in a thread: register once at start
(Redis unreachable: the service does not start, since nobody could find it), renew, leave on shutdown. A
Redis outage after start is logged and retried: the registration lapses and comes back with Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import cast

import redis

from shared import log
from shared.names import RedisKeys
from shared.outage import DEPENDENCY_ERRORS
from shared.settings import ReplicaSettings

_log = log.get(__name__)


class Members:
    """The live replicas of one ``kind`` in one deployment."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, kind: str) -> None:
        self.client = client
        self.kind = kind
        self.key = keys.members(kind)

    def beat(self, url: str, ttl_s: float, now: float | None = None) -> None:
        """Register ``url`` (or renew it) until ``ttl_s`` from now."""
        self.client.zadd(self.key, {url: (time.time() if now is None else now) + ttl_s})

    def leave(self, url: str) -> None:
        self.client.zrem(self.key, url)

    def live(self, now: float | None = None, forget: bool = True) -> list[str]:
        """Registered URLs whose registration has not expired, sorted; expired ones are forgotten
        (unless ``forget`` is false: ``rein status`` only reads)."""
        t = time.time() if now is None else now
        if not forget:
            return sorted(cast(list[str], self.client.zrangebyscore(self.key, t, "+inf")))
        with self.client.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(self.key, "-inf", t)
            pipe.zrangebyscore(self.key, t, "+inf")
            _, urls = pipe.execute()
        return sorted(cast(list[str], urls))


def advertised(template: str) -> str:
    """``REIN_ADVERTISE_URL`` with ``{ip}`` replaced by the address this host's name resolves to."""
    return template.replace("{ip}", socket.gethostbyname(socket.gethostname())) if "{ip}" in template else template


class Registration:
    """This replica's registration among ``members`` (of their kind), kept alive."""

    def __init__(self, members: Members, settings: ReplicaSettings) -> None:
        self.members = members
        self.settings = settings
        self.url = advertised(settings.advertise_url)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register (raises what Redis raised) and start renewing."""
        await asyncio.to_thread(self.members.beat, self.url, self.settings.registration_ttl_s)
        _log.info("registered", kind=self.members.kind, url=self.url, ttl_s=self.settings.registration_ttl_s)
        self._task = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        s = self.settings
        while True:
            await asyncio.sleep(s.heartbeat_s)
            try:
                await asyncio.to_thread(self.members.beat, self.url, s.registration_ttl_s)
            except DEPENDENCY_ERRORS as exc:
                _log.warning("registration_not_renewed", kind=self.members.kind, url=self.url, error=str(exc))

    async def stop(self) -> None:
        """Stop renewing and leave, so the others stop using this replica at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await asyncio.to_thread(self.members.leave, self.url)
        except DEPENDENCY_ERRORS as exc:
            _log.warning("leave_failed", kind=self.members.kind, url=self.url, error=str(exc))
