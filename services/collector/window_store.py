"""The one version window all collector replicas share, in Redis.

Each completed group goes through :meth:`WindowStore.step`: an optimistic
WATCH/MULTI transaction that loads the window (current label, pending groups,
counters), gets every needed label's index from the :class:`RedisRegistry`, runs
the pure :func:`shared.window_rule.window_step` (the only copy of the rules), and
writes back the new state, the ``decided`` mark of every group it decided, and the
records to publish (decisions, a manifest, a retry request) onto the Redis outbox
list (:mod:`services.collector.outbox`, which also publishes it), all in one EXEC.
A concurrent step by another replica changes the watched window hash, so EXEC fails
and the step is recomputed (bounded retries).

The keys' layout (what each hash field holds and how it is encoded) is
:mod:`shared.window_layout`, which ``rein status`` reads through.

Idempotency: a group id already in the ``decided`` hash is never decided again. The
hash is bounded by :meth:`WindowStore.trim_decided`, which forgets marks older than a TTL
that outlives the input topics' retention (see :mod:`shared.topology`).

Optimistic retries back off (jittered, doubling from 1 ms to 50 ms), so replicas that
collide do not retry in lockstep.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import redis

from services.collector.outbox import Outbox
from shared.names import RedisKeys, Topics
from shared.schemas import (
    BatchManifest,
    DecisionRecord,
    GapInfo,
    GroupRef,
    Record,
    RetryRequest,
    WindowInfo,
)
from shared.staleness import (
    Decision,
    StepResult,
    WindowGroup,
    WindowSettings,
    WindowSnapshot,
    WindowState,
    next_attempt,
)
from shared.state import RedisRegistry, Replication
from shared.window_layout import decode_window, drops_field, encode_config, encode_window
from shared.window_rule import window_step


class WindowConflict(RuntimeError):
    """A window step lost the optimistic race more times than allowed."""


class ConfigMismatch(RuntimeError):
    """This replica's window settings differ from the ones the shared window was started with."""


class WindowLost(RuntimeError):
    """The shared window's keys vanished from Redis while replicas ran (Redis restarted empty, or a flush).

    Going on would restart batch numbering at 0 and forget pending groups; the trainer would skip
    the renumbered manifests as already trained. Fatal with a clear message instead."""


@dataclass(frozen=True)
class StepOutcome:
    """What one step did: None ``result`` means the group had already been decided."""

    group_id: str
    result: StepResult | None
    step: int | None
    records: tuple[tuple[str, Record], ...]


def _window_info(snap: WindowSnapshot) -> WindowInfo:
    return WindowInfo(
        keep_versions=snap.keep_versions,
        current_version=snap.current_version,
        current_index=snap.current_index,
        cutoff_index=snap.cutoff_index,
    )


def _group_to_json(group: WindowGroup, ref: GroupRef) -> str:
    return json.dumps(
        {
            "group_id": group.group_id,
            "prompt_id": group.prompt_id,
            "attempt": group.attempt,
            "failed": group.failed,
            "versions": list(group.versions),
            "signal": group.signal,
            "tokens": group.tokens,
            "members": list(group.members),
            "member_tokens": list(group.member_tokens),
            "withheld": list(group.withheld),
            "ref": ref.model_dump(),
        }
    )


def _group_from_json(text: str) -> tuple[WindowGroup, GroupRef]:
    obj = json.loads(text)
    group = WindowGroup(
        obj["group_id"], obj["prompt_id"], int(obj["attempt"]), bool(obj["failed"]), tuple(obj["versions"]),
        signal=bool(obj.get("signal", True)),  # absent: pending before the signal rule, judged with signal
        tokens=int(obj.get("tokens", 0)),  # absent: pending before tokens were counted
        # absent: pending before members were recorded (judged whole)
        members=tuple(obj.get("members", ())),
        member_tokens=tuple(int(n) for n in obj.get("member_tokens", ())),
        withheld=tuple(obj.get("withheld", ())),
    )
    return group, GroupRef.model_validate(obj["ref"])


class WindowStore:
    """Shared window state in Redis; steps are atomic across replicas, outputs go through an outbox."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        topics: Topics,
        config: WindowSettings,
        *,
        replica: str,
        max_attempts: int = 200,
        lock_ms: int = 10_000,
        replication: Replication | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.topics = topics
        self.config = config
        self.replica = replica
        self.replication = replication or Replication()
        self.registry = RedisRegistry(client, keys, self.replication)
        self.max_attempts = max_attempts
        self.conflicts = 0
        self.outbox = Outbox(client, keys, replica=replica, lock_ms=lock_ms, replication=self.replication)

    # ------------------------------------------------------------------ config

    def claim_config(self, overwrite: bool = False) -> None:
        """Record this window's settings, or fail when the shared window runs with different ones, or when
        Redis holds a window under the key layout before the hash tag (``rein:window:config``): claiming a
        fresh one beside it would restart manifest numbering at 0, which a resumed trainer skips."""
        want = encode_config(self.config)
        key = self.keys.window_config
        untagged = f"{self.keys.prefix}:window:config"
        if untagged != key and not self.client.exists(key) and self.client.exists(untagged):
            raise WindowLost(
                f"Redis holds a window under the old key layout ({untagged}) and none under this one ({key}): "
                "the run was started by an older rein. Stop its services and run `rein migrate` to go on with "
                f"it, or delete its keys (`{self.keys.prefix}:*`) to start over, or use another "
                "REIN_REDIS__KEY_PREFIX."
            )
        if overwrite:
            self.client.hset(key, mapping=dict(want))  # type: ignore[arg-type]
            return
        for name, value in want.items():
            self.client.hsetnx(key, name, value)
        have: dict[str, str] = self.client.hgetall(key)  # type: ignore[assignment]
        differ = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        if differ:
            detail = ", ".join(f"{k}: shared window has {h}, this replica {w}" for k, (h, w) in differ.items())
            raise ConfigMismatch(
                f"window settings differ from the shared window at {key} ({detail}); every replica must use the "
                "same REIN_KEEP_VERSIONS / REIN_BATCH_GROUPS / REIN_MAX_RETRIES / REIN_MAX_FREE_RETRIES / "
                "REIN_NO_SIGNAL_GROUPS / REIN_STALE_GROUPS. To change them, stop all replicas and start one "
                "with REIN_RECONFIGURE=true."
            )

    # ------------------------------------------------------------------ reads

    def decided(self, group_ids: list[str]) -> dict[str, str]:
        """group id -> decision for the ids already decided."""
        if not group_ids:
            return {}
        values: list[str | None] = self.client.hmget(self.keys.decided, group_ids)  # type: ignore[assignment]
        return {gid: v for gid, v in zip(group_ids, values, strict=True) if v is not None}

    def registered(self, labels: list[str]) -> list[bool]:
        """Whether each label was published (has a sequence number) in the registry."""
        return [seq is not None for seq in self.registry.seqs(labels)]

    # ------------------------------------------------------------------ the step

    def _load(self, pipe: Any) -> tuple[WindowState, dict[str, GroupRef], int]:
        window: dict[str, str] = pipe.hgetall(self.keys.window)
        order: list[str] = pipe.lrange(self.keys.pending_order, 0, -1)
        raw: list[str | None] = pipe.hmget(self.keys.pending, order) if order else []
        pending: list[WindowGroup] = []
        refs: dict[str, GroupRef] = {}
        for text in raw:
            if text is None:
                continue
            group, ref = _group_from_json(text)
            pending.append(group)
            refs[group.group_id] = ref
        hashed = decode_window(window)
        state = WindowState(
            current=hashed.current,
            pending=tuple(pending),
            batches=hashed.batches,
            dropped_since_batch=hashed.dropped_since,
            drops_total=hashed.drops_total,
            no_signal_run=hashed.no_signal_run,
            tokens=hashed.tokens,
        )
        return state, refs, hashed.steps

    def step(self, group: WindowGroup, ref: GroupRef, prompt: dict[str, Any] | None = None) -> StepOutcome:
        """Decide one completed group atomically for all replicas; idempotent per group id. Returns once the
        decision is on ``replication``'s replicas too (also when it was already taken: a retry after a
        failed wait waits again)."""
        if self.decided([group.group_id]):
            self.replication.wait(self.client, self.keys)
            return StepOutcome(group.group_id, None, None, ())
        # Unknown labels become "unregistered" here, outside the transaction: registering
        # writes registry keys, which must not happen under our own WATCH.
        self.registry.observe(list(group.versions))
        k = self.keys
        for _attempt in range(self.max_attempts):
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(k.window, k.registry_order, k.unregistered)  # type: ignore[no-untyped-call]
                    if pipe.hexists(k.decided, group.group_id):
                        pipe.reset()
                        self.replication.wait(self.client, self.keys)
                        return StepOutcome(group.group_id, None, None, ())
                    if not pipe.exists(k.window_config):
                        raise WindowLost(
                            f"the shared window's keys ({k.window_config}, {k.window}) are gone from Redis: it "
                            "restarted without its data or was flushed while the run went on. Restore its data "
                            "(deploy/redis.sh runs Redis with an append-only file) or start a fresh run."
                        )
                    state, refs, steps = self._load(pipe)
                    labels = sorted(
                        {*group.versions, *(v for g in state.pending for v in g.versions)}
                        | ({state.current} if state.current else set())
                    )
                    index = dict(zip(labels, self.registry.observe(labels), strict=True))
                    result = window_step(state, group, index.__getitem__, self.config)
                    refs[group.group_id] = ref
                    records = self._records(group, result, refs, prompt or {}, steps)
                    pipe.multi()
                    self._write(pipe, group, refs, state, result, records, steps)
                    pipe.execute()
                    self.replication.wait(self.client, self.keys)
                    return StepOutcome(group.group_id, result, steps, tuple(records))
                except redis.WatchError:
                    self.conflicts += 1
                    time.sleep(random.uniform(0.5, 1.0) * min(0.001 * 2**_attempt, 0.05))
                    continue
        raise WindowConflict(f"window step for group {group.group_id} lost {self.max_attempts} optimistic races")

    def _records(
        self,
        group: WindowGroup,
        result: StepResult,
        refs: dict[str, GroupRef],
        prompt: dict[str, Any],
        steps: int,
    ) -> list[tuple[str, Record]]:
        topics = self.topics
        out: list[tuple[str, Record]] = []
        for d in result.decisions:
            out.append(
                (
                    topics.decisions,
                    DecisionRecord(
                        group_id=d.group_id,
                        prompt_id=d.prompt_id,
                        attempt=d.attempt,
                        decision=d.decision.value,
                        versions=list(d.versions),
                        window=_window_info(d.window),
                        collector=self.replica,
                        step=steps,
                    ),
                )
            )
            if d.group_id == group.group_id and d.decision is Decision.FAILED_RETRY:
                attempt, free_retries = next_attempt(group, self.config)
                out.append(
                    (
                        topics.retries,
                        RetryRequest(
                            prompt_id=group.prompt_id,
                            attempt=attempt,
                            free_retries=free_retries,
                            previous_group_id=group.group_id,
                            prompt=prompt,
                        ),
                    )
                )
        batch = result.batch
        if batch is not None:
            gap = None if batch.gap is None else GapInfo(min=batch.gap.min, max=batch.gap.max, mean=batch.gap.mean)
            out.append(
                (
                    topics.batches,
                    BatchManifest(
                        batch_id=f"{self.keys.prefix}-batch-{batch.index:08d}",
                        index=batch.index,
                        groups=[refs[g.group_id].model_copy(update={"withheld": list(g.withheld)})
                                for g in batch.groups],
                        window=_window_info(batch.window),
                        version_gap=gap,
                        dropped=[{"group_id": gid, "decision": why} for gid, why in batch.dropped],
                        drops_in_batch=len(batch.dropped),
                        drops_cumulative=batch.drops_total,
                        generated_tokens_cumulative=batch.tokens.generated,
                        untrained_tokens_cumulative=batch.tokens.by_cause(),
                    ),
                )
            )
        return out

    def _write(
        self,
        pipe: Any,
        group: WindowGroup,
        refs: dict[str, GroupRef],
        before: WindowState,
        result: StepResult,
        records: list[tuple[str, Record]],
        steps: int,
    ) -> None:
        k = self.keys
        after = result.state
        pipe.hset(k.window, mapping=encode_window(after, steps + 1))
        # pending: rewrite the order, add the new group if kept, rewrite those with members newly
        # withheld, delete what left
        kept_ids = {g.group_id for g in after.pending}
        gone = [g.group_id for g in before.pending if g.group_id not in kept_ids]
        if gone:
            pipe.hdel(k.pending, *gone)
        held_before = {g.group_id: g.withheld for g in before.pending}
        for g in after.pending:
            if g.group_id == group.group_id or g.withheld != held_before.get(g.group_id, g.withheld):
                pipe.hset(k.pending, g.group_id, _group_to_json(g, refs[g.group_id]))
        pipe.delete(k.pending_order)
        if after.pending:
            pipe.rpush(k.pending_order, *[g.group_id for g in after.pending])
        decided = {d.group_id: d.decision.value for d in result.decisions}
        pipe.hset(k.decided, mapping=decided)
        pipe.zadd(k.decided_at, dict.fromkeys(decided, time.time()))
        for d in result.decisions:
            if d.decision is not Decision.KEPT:
                pipe.hincrby(k.window, drops_field(d.decision.value), 1)
        if records:
            self.outbox.push(pipe, records)

    def trim_decided(self, ttl_s: float, now: float | None = None, limit: int = 1000) -> int:
        """Forget up to ``limit`` ``decided`` marks older than ``ttl_s``; returns how many went.

        Safe for concurrent replicas (each removal is idempotent) and against a concurrent step
        (a mark is only written with a fresh time)."""
        k = self.keys
        cutoff = (time.time() if now is None else now) - ttl_s
        old: list[str] = self.client.zrangebyscore(k.decided_at, "-inf", cutoff, start=0, num=limit)  # type: ignore[assignment]
        if not old:
            return 0
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hdel(k.decided, *old)
            pipe.zrem(k.decided_at, *old)
            pipe.execute()
        return len(old)
