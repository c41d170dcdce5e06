"""Who is alive: replicas that register themselves in Redis, and the pause a newcomer must join.

A proxy started with ``REIN_ADVERTISE_URL`` renews its registration every few seconds; the
registration expires by itself when the proxy dies, so the broadcaster's list of proxies to pause is
always the live ones, without a configured list (``REIN_PROXY_URLS`` still adds fixed ones). While a
broadcaster holds the proxies paused for an update, the pause is in Redis too, expiring with its
lease: a proxy that starts in the middle joins it before it registers, so no proxy ever serves
generations while the engines change weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import cast

import redis

from shared.names import RedisKeys

_END_PAUSE = """
local held = redis.call('GET', KEYS[1])
if held and cjson.decode(held)['pause_id'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Members:
    """The live replicas of one kind (``proxy``) in one deployment."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, kind: str = "proxy") -> None:
        self.client = client
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


@dataclass(frozen=True)
class HeldPause:
    pause_id: str
    reason: str
    lease_left_s: float


class PauseRecord:
    """The broadcaster's pause in progress, as a newcomer sees it."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self.client = client
        self.key = keys.pause
        self._end = client.register_script(_END_PAUSE)

    def hold(self, pause_id: str, reason: str, lease_s: float) -> None:
        """Record (or renew) ``pause_id`` for ``lease_s``."""
        self.client.set(self.key, json.dumps({"pause_id": pause_id, "reason": reason}), px=int(lease_s * 1000))

    def renew(self, lease_s: float) -> None:
        """Extend the recorded pause to ``lease_s`` from now."""
        self.client.pexpire(self.key, int(lease_s * 1000))

    def end(self, pause_id: str) -> None:
        """Forget ``pause_id`` (a newer pause recorded meanwhile is left alone)."""
        self._end(keys=[self.key], args=[pause_id])

    def current(self) -> HeldPause | None:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.get(self.key)
            pipe.pttl(self.key)
            raw, ttl_ms = pipe.execute()
        if raw is None or int(ttl_ms) <= 0:
            return None
        held = json.loads(raw)
        return HeldPause(str(held["pause_id"]), str(held.get("reason", "")), int(ttl_ms) / 1000)
