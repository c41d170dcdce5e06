"""The collector's outbox: records a window step decided, kept in Redis until Kafka acked them.

:meth:`Outbox.push` appends a step's records to the outbox list inside the step's own
transaction (:mod:`services.collector.window_store`), so a decision and what it publishes
are written together. :meth:`Outbox.drain` publishes the list: under a lease lock, from
the head, in step order (so manifests reach ``train.batches`` in index order), once the
replicas hold the entries (:class:`shared.state.Replication`: another replica's step, not
yet replicated, must not reach Kafka before a failover could forget it), waits for
the broker's acks, then trims exactly what it published (a fenced Lua script: only while
it still holds the lease and the head is unchanged). A replica killed between the ack and
the trim leaves entries that the next drainer publishes again: duplicates are possible only
as the same bytes under the same key (same group decision, same manifest
``index``/``batch_id``), and consumers dedupe by key.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from shared import log
from shared.bus import Delivered
from shared.codec import decode, encode
from shared.names import RedisKeys
from shared.schemas import Record
from shared.state import Replication

_log = log.get(__name__)

Publish = Callable[[list[tuple[str, Record]]], list[Delivered]]


# KEYS: outbox, lock; ARGV: token, n, first entry, last entry
_TRIM = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local n = tonumber(ARGV[2])
if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[3] or redis.call('LINDEX', KEYS[1], n - 1) ~= ARGV[4] then
  return -2
end
redis.call('LTRIM', KEYS[1], n, -1)
return n
"""

# KEYS: lock; ARGV: token
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lock; ARGV: token, lease ms
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class Outbox:
    """The outbox list of one shared window and its drain lease."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, *, replica: str, lock_ms: int = 10_000,
                 replication: Replication | None = None) -> None:
        self.client = client
        self.keys = keys
        self.replica = replica
        self.lock_ms = lock_ms
        self.replication = replication or Replication()
        self._trim = client.register_script(_TRIM)
        self._release = client.register_script(_RELEASE)
        self._extend = client.register_script(_EXTEND)

    def push(self, pipe: Any, records: list[tuple[str, Record]]) -> None:
        """Queue ``(topic, record)`` pairs at the tail, inside the caller's transaction ``pipe``."""
        pipe.rpush(self.keys.outbox, *[self._entry(topic, record) for topic, record in records])

    @staticmethod
    def _entry(topic: str, record: Record) -> str:
        return json.dumps(
            {"id": uuid.uuid4().hex, "topic": topic, "record": base64.b64encode(encode(record)).decode("ascii")}
        )

    def drain(self, publish: Publish, timeout_s: float = 30.0, chunk: int = 500) -> int:
        """Publish every outbox entry in order under the lease; returns how many this call published."""
        token = uuid.uuid4().hex
        k = self.keys
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while not self.client.set(k.outbox_lock, token, nx=True, px=self.lock_ms):
            if time.monotonic() > deadline:
                raise TimeoutError(f"outbox lock {k.outbox_lock} still held after {timeout_s}s")
            time.sleep(delay)  # polling a lease held by another replica: no event to wait on
            delay = min(delay * 2, 0.05)
        published = 0
        try:
            while True:
                entries: list[str] = self.client.lrange(k.outbox, 0, chunk - 1)  # type: ignore[assignment]
                if not entries:
                    return published
                items = []
                for text in entries:
                    obj = json.loads(text)
                    items.append((str(obj["topic"]), decode(base64.b64decode(obj["record"]))))
                self.replication.wait(self.client, k)
                publish(items)
                trimmed = self._trim(
                    keys=[k.outbox, k.outbox_lock], args=[token, len(entries), entries[0], entries[-1]]
                )
                if int(trimmed) < 0:
                    _log.warning("outbox_lease_lost", replica=self.replica, entries=len(entries))
                    return published
                published += len(entries)
                self._extend(keys=[k.outbox_lock], args=[token, self.lock_ms])
        finally:
            self._release(keys=[k.outbox_lock], args=[token])
