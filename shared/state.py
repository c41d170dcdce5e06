"""Redis helpers: a bounded connection and the version registry shared by all services.

The registry keeps the versions' order (:mod:`shared.versions`) in Redis so it survives restarts and is the same
for every replica: published labels by sequence number (a sorted set, so an index
is O(log n)), then labels nobody published in observation order. Every change is
one Lua script, hence atomic. The ``weights`` topic owns the order (the trainer's
sequence numbers); the broadcaster and every collector replica publish what they read
from it, idempotently (a label keeps the sequence it was first published with, a
conflicting one is refused), so the registry can always be rebuilt from the topic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.connection import parse_url
from redis.sentinel import Sentinel

from shared import log
from shared.names import RedisKeys
from shared.settings import RedisSettings

_log = log.get(__name__)


class StateUnavailable(RuntimeError):
    """Redis could not be reached within the configured bound."""


def client_for(settings: RedisSettings, socket_timeout_s: float | None = None) -> redis.Redis:
    """An unchecked client: on ``url``, or, with ``sentinels``, on whichever server they name the primary
    (each new connection asks them again, so a client outlives a failover: its calls fail while the old
    primary is gone, then reach the new one)."""
    timeout = settings.socket_timeout_s if socket_timeout_s is None else socket_timeout_s
    options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                               "decode_responses": True, "health_check_interval": 30}
    if not settings.sentinels:
        return redis.Redis.from_url(settings.url, **options)
    url: dict[str, Any] = parse_url(settings.url)  # type: ignore[no-untyped-call]
    sentinel = Sentinel(
        [(host, int(port)) for host, _, port in (s.rpartition(":") for s in settings.sentinels)],
        sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout},
    )
    client: redis.Redis = sentinel.master_for(settings.sentinel_master, db=url.get("db", 0),
                                              password=url.get("password"), username=url.get("username"), **options)
    return client


def connect(settings: RedisSettings, attempts: int = 5) -> redis.Redis:
    """A client with socket timeouts, checked with PING (bounded retries, then a clear error)."""
    client = client_for(settings)
    delay = 0.25
    for attempt in range(1, attempts + 1):
        try:
            client.ping()
            return client
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            where = f"the primary of {settings.sentinel_master!r} (sentinels {settings.sentinels})" \
                if settings.sentinels else f"Redis at {settings.url}"
            if attempt == attempts:
                raise StateUnavailable(f"{where} did not answer after {attempts} attempts: {exc}") from exc
            _log.warning("redis_unavailable", url=settings.url, sentinels=settings.sentinels, attempt=attempt,
                         retry_in_s=delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Replication:
    """How many replicas must hold a write before its effects may reach Kafka (``RedisSettings.replicas_acked``)."""

    replicas: int = 0
    timeout_s: float = 2.0

    @classmethod
    def of(cls, settings: RedisSettings) -> Replication:
        return cls(settings.replicas_acked, settings.replica_ack_timeout_s)

    def wait(self, client: redis.Redis, keys: RedisKeys) -> None:
        """Block until every replica in sync with the primary, and at least ``replicas``, holds every write made
        so far; fewer within the bound is an outage: the caller retries, and its retry is idempotent.

        Every in-sync replica, not just ``replicas`` of them: Sentinel promotes a replica by the replication
        offsets it last read (up to seconds old), so it may pick one that lacks a write another replica
        acknowledged. A replica that is down or still syncing is not waited for, so one lost replica of two
        does not stop writes.

        Redis' WAIT covers the writes of the connection it runs on, and a pool may hand out another one
        than the write used. So WAIT follows a write of its own on the same connection (one pipeline):
        replicas apply the one replication stream in order, so holding that write means holding every
        write before it, from any connection."""
        if self.replicas <= 0:
            return
        need = max(self.replicas, in_sync_replicas(client))
        with client.pipeline(transaction=False) as pipe:
            pipe.incr(keys.replicated)
            pipe.wait(need, int(self.timeout_s * 1000))
            _, acked = pipe.execute()
        if int(acked) < need:
            raise StateUnavailable(f"{acked} of {need} Redis replicas acknowledged a write within "
                                   f"{self.timeout_s}s: not acting on it until they do")


def in_sync_replicas(client: redis.Redis) -> int:
    """How many replicas the primary streams to (``state=online`` in INFO replication)."""
    info: dict[str, Any] = client.info("replication")
    return sum(1 for name, value in info.items()
               if name.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")


# KEYS: registry hash, registry order zset, unregistered zset; ARGV: label, seq
_PUBLISH = """
local known = redis.call('HGET', KEYS[1], ARGV[1])
if known then
  if tonumber(known) == tonumber(ARGV[2]) then return 0 end
  return redis.error_reply('version ' .. ARGV[1] .. ' already published with sequence ' .. known)
end
local holders = redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[2], ARGV[2])
if #holders > 0 then
  return redis.error_reply('sequence ' .. ARGV[2] .. ' already used by version ' .. holders[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# KEYS: registry order zset, unregistered zset, unregistered counter; ARGV: labels...
# Returns the index of every label, registering unknown ones as unregistered.
_OBSERVE = """
local published = redis.call('ZCARD', KEYS[1])
local out = {}
for i, label in ipairs(ARGV) do
  local rank = redis.call('ZRANK', KEYS[1], label)
  if rank then
    out[i] = rank
  else
    if not redis.call('ZSCORE', KEYS[2], label) then
      local n = redis.call('INCR', KEYS[3])
      redis.call('ZADD', KEYS[2], n, label)
    end
    out[i] = published + redis.call('ZRANK', KEYS[2], label)
  end
end
return out
"""


class RedisRegistry:
    """The version registry in Redis (same order as ``shared.versions.VersionRegistry``)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, replication: Replication | None = None) -> None:
        self.client = client
        self.keys = keys
        self.replication = replication or Replication()
        self._publish = client.register_script(_PUBLISH)
        self._observe = client.register_script(_OBSERVE)

    def publish(self, label: str, seq: int) -> bool:
        """Register the real label ``label`` at ``seq``; idempotent for the same pair, an error for a conflict."""
        k = self.keys
        try:
            created = self._publish(keys=[k.registry, k.registry_order, k.unregistered], args=[label, seq])
        except redis.ResponseError as exc:
            raise ValueError(str(exc)) from None
        self.replication.wait(self.client, k)
        return bool(created)

    def observe(self, labels: list[str]) -> list[int]:
        """Indices of ``labels`` (real, normalised), registering unknown ones after the published."""
        if not labels:
            return []
        k = self.keys
        result = self._observe(keys=[k.registry_order, k.unregistered, k.unregistered_counter], args=labels)
        return [int(x) for x in cast(list[Any], result)]

    def seqs(self, labels: list[str]) -> list[int | None]:
        """The sequence each label was published with (None: not published)."""
        if not labels:
            return []
        values = cast(list[str | None], self.client.hmget(self.keys.registry, labels))
        return [None if v is None else int(v) for v in values]

    def count(self) -> int:
        """How many versions are published."""
        return int(self.client.zcard(self.keys.registry_order))

    def ordered(self) -> list[tuple[str, int]]:
        """Published (label, seq) pairs in order."""
        pairs = cast(list[tuple[str, float]], self.client.zrange(self.keys.registry_order, 0, -1, withscores=True))
        return [(label, int(score)) for label, score in pairs]

    def unregistered(self) -> list[str]:
        return cast(list[str], self.client.zrange(self.keys.unregistered, 0, -1))
