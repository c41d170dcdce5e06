"""Sessions kept in Redis between calls, so another proxy replica continues one whose proxy died.

Each session has a hash (``RedisKeys.session``): its ``owner`` (one proxy process), ``calls`` (calls begun),
``saved`` and ``state`` (the number of the last call after which its snapshot was written, and the
snapshot, :mod:`services.proxy.session_snapshot`) or ``end`` (how it ended), and ``taken_from`` (the
owner before the last takeover). The owner writes ``calls`` before each call reaches an engine (a
finish and an idle expiry count as calls) and the snapshot once that call's chunks are all acked, so a
replica that gets a call for a session it does not hold reads one of three things:

- ``saved == calls``: every chunk the session published is in its snapshot; it takes the session over
  (``owner`` is now itself) and continues it token-exact, chunks numbered on from the snapshot's;
- ``saved < calls``: its proxy was in a call (or had not heard every ack) when it stopped answering: the
  chunks of that call may be partly on Kafka, so the session is refused (``session_interrupted``) and
  its runner ends it as lost; its group is retried;
- no hash: the session made no call yet, or ended long ago: it starts here.

Every write is a script that checks ``owner`` first: a replica that was only out of the balancer's
rotation (not dead) finds at its next call, finish or idle expiry that the session moved, and drops its
stale copy (``session_moved``), so two replicas never both publish records of one session.

Redis down: a call goes on after at most :data:`MARK_TIMEOUT_S`, unmarked, so the snapshot written after
it is refused until a later call marks again (the session is continued from an older snapshot only if its
proxy dies while Redis is down too; the collector then refuses the chunks that conflict); a takeover
answers 503.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import redis

from services.proxy.metrics import ProxyMetrics
from services.proxy.publisher import Ack
from services.proxy.session_machine import Session
from services.proxy.session_snapshot import snapshot
from shared import log
from shared.errors import SessionBusy, SessionFinalized, SessionInterrupted, SessionMoved, StateStoreUnavailable
from shared.names import RedisKeys

_log = log.get(__name__)

MARK_TIMEOUT_S = 1.0
"""How long a call waits for its mark: past it the call goes on unmarked, as with Redis down (the client's
own retries would hold every call for seconds while Redis fails over)."""

_BEGIN = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return owner end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'calls', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return false
"""

_SAVE = """
local h = redis.call('HMGET', KEYS[1], 'owner', 'calls', 'end')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] then return 0 end
redis.call('HSET', KEYS[1], 'saved', ARGV[2], 'state', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""

_TAKE = """
local h = redis.call('HMGET', KEYS[1], 'owner', 'calls', 'saved', 'state', 'end')
if h[5] then return {'end', h[5]} end
if not h[1] then return {'absent'} end
if h[1] == ARGV[1] then return {'mine'} end
if h[2] ~= h[3] or not h[4] then return {'interrupted', h[1]} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'taken_from', h[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'state', h[4], h[2]}
"""

_END = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'state', 'saved', 'calls')
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'end', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


class Handoff:
    """One proxy process's side of the sessions' hashes: mark, save, take over, end."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, owner: str, ttl_s: float, ack_bound_s: float,
                 metrics: ProxyMetrics) -> None:
        self.keys = keys
        self.owner = owner
        """This process (its advertised URL and a random part: a restarted proxy is another owner)."""
        self._ttl_ms = str(int(ttl_s * 1000))
        self._ack_bound_s = ack_bound_s
        self._metrics = metrics
        self._begin = client.register_script(_BEGIN)
        self._save = client.register_script(_SAVE)
        self._take = client.register_script(_TAKE)
        self._end = client.register_script(_END)
        self._calls: dict[str, int] = {}
        """Calls begun per session held here (continued from the hash's on a takeover)."""
        self._saves: dict[str, asyncio.Task[None]] = {}
        self._ends: set[asyncio.Task[None]] = set()

    async def take(self, session_id: str) -> dict[str, Any] | None:
        """The snapshot of a session this proxy does not hold, now its own; None when it has none (a new session).
        Refused: ``session_interrupted`` (its proxy stopped during a call), ``session_finalized`` (it ended on
        another replica), ``session_busy`` (another request of it is taking it over here); 503 when Redis does
        not answer (a new session here could repeat the other's chunks)."""
        try:
            answer = await asyncio.to_thread(self._take, keys=[self.keys.session(session_id)],
                                             args=[self.owner, self._ttl_ms])
        except redis.RedisError as exc:
            self._failed("take", session_id, exc)
            raise StateStoreUnavailable(f"Redis did not answer for session {session_id}, which this proxy does not "
                                        f"hold: try again ({type(exc).__name__}: {exc})", session_id=session_id
                                        ) from None
        kind = answer[0]
        if kind == "absent":
            return None
        if kind == "mine":  # taken over here by another request of the session, still being restored
            raise SessionBusy(f"session {session_id} already has a call in flight", session_id=session_id)
        if kind == "end":
            self._metrics.takeovers.labels(outcome="ended").inc()
            raise SessionFinalized(f"session {session_id} is {answer[1]} (on another proxy replica); it takes no more "
                                   "calls", session_id=session_id, outcome=answer[1])
        if kind == "interrupted":
            self._metrics.takeovers.labels(outcome="interrupted").inc()
            _log.warning("session_interrupted", session_id=session_id, owner=answer[1])
            raise SessionInterrupted(
                f"session {session_id} was in a call on the proxy replica that held it ({answer[1]}) when it stopped "
                "answering: that call's records may be partly written, so no replica continues it",
                session_id=session_id, owner=answer[1],
            )
        self._calls[session_id] = int(answer[2])
        try:
            state = json.loads(answer[1])
        except ValueError:
            state = None
        return state if isinstance(state, dict) else {}

    def taken(self, session_id: str, unreadable: str = "") -> None:
        """Count a takeover whose snapshot was restored, or raise ``session_interrupted`` for one that could not be
        read (``unreadable`` says why; the session is then refused like an interrupted one)."""
        self._metrics.takeovers.labels(outcome="unreadable" if unreadable else "continued").inc()
        if unreadable:
            self.forget(session_id)
            _log.error("session_snapshot_unreadable", session_id=session_id, error=unreadable)
            raise SessionInterrupted(f"session {session_id}: the snapshot its proxy replica left cannot be read here "
                                     f"({unreadable})", session_id=session_id)
        _log.info("session_taken_over", session_id=session_id, calls=self._calls.get(session_id))

    async def begin(self, session_id: str) -> None:
        """Mark a call (a finish, an idle expiry) begun, before it reaches an engine or Kafka; ``session_moved`` when
        another replica took the session over (this copy is stale). A Redis failure is logged, and the call goes on."""
        self._drop_save(session_id)  # superseded: its ``calls`` is no longer the hash's once this call is marked
        calls = self._calls.get(session_id, 0) + 1
        self._calls[session_id] = calls
        try:
            other = await asyncio.wait_for(asyncio.to_thread(
                self._begin, keys=[self.keys.session(session_id)], args=[self.owner, str(calls), self._ttl_ms]),
                MARK_TIMEOUT_S)
        except (redis.RedisError, TimeoutError) as exc:
            self._failed("begin", session_id, exc)
            return
        if other:
            self._calls.pop(session_id, None)
            self._metrics.moved.inc()
            raise SessionMoved(f"session {session_id} was taken over by another proxy replica ({other}); this one "
                               "takes no more of its calls", session_id=session_id, owner=other)

    def save(self, session: Session, acks: Sequence[Ack]) -> None:
        """Write ``session``'s snapshot once ``acks`` (its chunks not yet answered) all succeeded; if one failed
        or none came in time, nothing is written: a takeover then refuses the session. The snapshot is taken
        then, not now: until another call (or a finish, an expiry) is marked the session does not change, and
        an agent that calls again sooner supersedes it unwritten, so no call pays for copying its session."""
        sid = session.session_id
        calls = self._calls.get(sid)
        if calls is None or session.lost is not None:
            return
        task = asyncio.create_task(self._write(session, calls, list(acks)))
        self._saves[sid] = task
        task.add_done_callback(lambda t: self._saves.pop(sid, None) if self._saves.get(sid) is t else None)

    async def _write(self, session: Session, calls: int, acks: list[Ack]) -> None:
        if acks:
            await asyncio.wait(acks, timeout=self._ack_bound_s)
            if any(not ack.done() or ack.exception() is not None for ack in acks):
                return
        session_id = session.session_id
        if self._calls.get(session_id) != calls or session.phase != "open" or session.lost is not None:
            return  # another call, a finish or an expiry began meanwhile: this snapshot is superseded
        state = snapshot(session)
        try:
            await asyncio.to_thread(self._dump_and_save, session_id, calls, state)
        except (redis.RedisError, TypeError, ValueError) as exc:
            self._failed("save", session_id, exc)

    def _dump_and_save(self, session_id: str, calls: int, state: dict[str, Any]) -> None:
        self._save(keys=[self.keys.session(session_id)],
                   args=[self.owner, str(calls), json.dumps(state, separators=(",", ":")), self._ttl_ms])

    def ended(self, session_id: str, outcome: str) -> None:
        """Record how the session ended (a later call on any replica gets 409), in the background."""
        self.forget(session_id)
        task = asyncio.create_task(self._record_end(session_id, outcome))
        self._ends.add(task)
        task.add_done_callback(self._ends.discard)

    async def _record_end(self, session_id: str, outcome: str) -> None:
        try:
            await asyncio.to_thread(self._end, keys=[self.keys.session(session_id)],
                                    args=[self.owner, outcome, self._ttl_ms])
        except redis.RedisError as exc:
            self._failed("end", session_id, exc)

    def forget(self, session_id: str) -> None:
        """The session ended or moved away: no snapshot of it is written any more."""
        self._drop_save(session_id)
        self._calls.pop(session_id, None)

    def _drop_save(self, session_id: str) -> None:
        pending = self._saves.pop(session_id, None)
        if pending is not None:
            pending.cancel()

    async def close(self, timeout_s: float) -> None:
        """Let the writes in progress end (bounded: a snapshot still waiting for acks then, is not written)."""
        tasks = [*self._saves.values(), *self._ends]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()

    def _failed(self, op: str, session_id: str, exc: BaseException) -> None:
        self._metrics.handoff_errors.labels(op=op).inc()
        _log.warning("session_store_failed", op=op, session_id=session_id, error=f"{type(exc).__name__}: {exc}")
