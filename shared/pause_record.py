"""The broadcaster's pause in progress, recorded in Redis for a proxy that starts in the middle of it.

While a broadcaster holds the proxies paused for a weight update, the pause is in Redis too, expiring
with its lease: a proxy that starts meanwhile joins it before it registers (:mod:`shared.membership`),
so no proxy ever serves generations while the engines change weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from shared.names import RedisKeys

_END_PAUSE = """
local held = redis.call('GET', KEYS[1])
if held and cjson.decode(held)['pause_id'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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
