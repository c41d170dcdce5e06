"""Chunks and events -> completed GRPO groups, and which records' work is done. Pure: no I/O.

Lifecycle of a group in the :class:`Assembler`:

1. *assembling*: records arrive in any order (chunks and events are different
   topics), possibly before the group's ``GroupDispatched``, possibly published
   twice (same session and seq at another offset: the first copy wins). A record
   re-delivered at the same offset never gets here (:mod:`shared.offsets` drops it).
   Every record's position is held by its group.
2. *complete*: the dispatch record is in, every dispatched session has its end
   event (finished or rejected) and all ``num_chunks`` chunks (seq 0..n-1). The first
   end of a session wins; a rejection of unknown ``num_chunks`` (published by the
   rollout runner for a session its proxy lost) needs no chunks.
   :meth:`Assembler.add` returns the :class:`CompletedGroup` once. A group silent
   for the incomplete timeout is completed as failed by :meth:`Assembler.expire`.
3. *released*: the shell made the group's outputs durable (audit record, window
   step, outbox published) and calls :meth:`Assembler.release`; its positions are
   done and its id is remembered as done, so late duplicates are ignored.

Positions whose work is done (a released group's, and records that need no output:
other record types, records of a group already done) are handed to the shell by
:meth:`Assembler.take_done`, which marks them done in the consumer's
:class:`shared.offsets.Offsets`; commits never pass a record of a group not released,
so a crash re-reads every group that was not.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared.errors import INCOMPLETE
from shared.schemas import (
    Chunk,
    CompletedGroup,
    GroupDispatched,
    Record,
    SamplingParams,
    Segment,
    SessionFinished,
    SessionRejected,
    Trajectory,
)
from shared.versions import encode_runs

TopicPartition = tuple[str, int]

CONFLICTING_CHUNKS = "conflicting_chunks"
"""Error of a session two different chunks claimed the same place in: two proxies served it (a call
retried elsewhere, a balancer that moved it). Neither stream is the sequence one engine continued, so
nothing of it is trained."""


@dataclass(frozen=True)
class Position:
    """Where a record was read: topic, partition, offset."""

    topic: str
    partition: int
    offset: int

    @property
    def tp(self) -> TopicPartition:
        return (self.topic, self.partition)


@dataclass
class _Session:
    chunks: dict[int, Chunk] = field(default_factory=dict)
    end: SessionFinished | SessionRejected | None = None
    conflict: bool = False
    """A different chunk came with a seq already held (a replay of the same record is not a conflict)."""

    def complete(self) -> bool:
        return self.end is not None and all(seq in self.chunks for seq in range(self.expected()))

    def expected(self) -> int:
        """How many chunks (seq 0..n-1) make the session whole; an end of unknown count takes what is here."""
        assert self.end is not None
        if self.end.num_chunks is not None:
            return self.end.num_chunks
        n = 0
        while n in self.chunks:
            n += 1
        return n


@dataclass
class _Group:
    dispatched: GroupDispatched | None = None
    sessions: dict[str, _Session] = field(default_factory=dict)
    positions: list[Position] = field(default_factory=list)
    emitted: bool = False
    last_seen: float = 0.0

    def session(self, session_id: str) -> _Session:
        held = self.sessions.get(session_id)
        if held is None:
            held = self.sessions[session_id] = _Session()
        return held

    def complete(self) -> bool:
        if self.dispatched is None:
            return False
        return all(sid in self.sessions and self.sessions[sid].complete() for sid in self.dispatched.session_ids)


@dataclass
class Expired:
    """What :meth:`Assembler.expire` ended: groups completed as failed, and ids dropped unbuilt."""

    failed: list[CompletedGroup] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def _runs(sampling: list[SamplingParams | None]) -> list[tuple[SamplingParams | None, int]]:
    """A segment's sampling runs; empty when no chunk recorded any (the trainer's default applies)."""
    return encode_runs(sampling) if any(p is not None for p in sampling) else []


def build_trajectory(session_id: str, session: _Session) -> Trajectory:
    """Concatenate a finished session's chunks (seq order) into segments.

    Context tokens get mask 0, logprob 0.0, version None; output tokens mask 1,
    their logprob, the version the engine reported for each of them and their chunk's
    sampling parameters. A segment's finish reason is its last chunk's.
    """
    end = session.end
    assert end is not None
    if session.conflict:
        return Trajectory(session_id=session_id, status="rejected", reward=0.0, error=CONFLICTING_CHUNKS, segments=[])
    segments: dict[int, dict[str, list[Any]]] = {}
    sampling: dict[int, list[SamplingParams | None]] = {}
    finish: dict[int, str] = {}
    for seq in range(session.expected()):
        chunk = session.chunks[seq]
        seg = segments.setdefault(
            chunk.segment_index, {"token_ids": [], "loss_mask": [], "logprobs": [], "versions": []}
        )
        n_ctx = len(chunk.context_ids)
        seg["token_ids"].extend(chunk.context_ids)
        seg["loss_mask"].extend([0] * n_ctx)
        seg["logprobs"].extend([0.0] * n_ctx)
        seg["versions"].extend([None] * n_ctx)
        n_out = len(chunk.output_ids)
        logprobs = list(chunk.logprobs[:n_out]) + [0.0] * max(0, n_out - len(chunk.logprobs))
        seg["token_ids"].extend(chunk.output_ids)
        seg["loss_mask"].extend([1] * n_out)
        seg["logprobs"].extend(logprobs)
        seg["versions"].extend(chunk.output_versions())
        sampling.setdefault(chunk.segment_index, []).extend([None] * n_ctx + [chunk.sampling] * n_out)
        finish[chunk.segment_index] = chunk.finish_reason
    built = [
        Segment(segment_index=index, finish_reason=finish[index], sampling=_runs(sampling[index]), **segments[index])
        for index in sorted(segments)
    ]
    if isinstance(end, SessionRejected):
        return Trajectory(session_id=session_id, status="rejected", reward=0.0, error=end.error, segments=built)
    error = end.error if end.status == "failed" else ""
    return Trajectory(session_id=session_id, status=end.status, reward=end.reward, error=error, segments=built)


def build_group(group: _Group) -> CompletedGroup:
    dispatched = group.dispatched
    assert dispatched is not None
    trajectories = [build_trajectory(sid, group.sessions[sid]) for sid in dispatched.session_ids]
    failed = any(t.status in ("rejected", "failed") for t in trajectories)
    return CompletedGroup(
        group_id=dispatched.group_id,
        prompt_id=dispatched.prompt_id,
        attempt=dispatched.attempt,
        failed=failed,
        trajectories=trajectories,
        prompt=dispatched.prompt,
        free_retries=dispatched.free_retries,
    )


class Assembler:
    """Folds decoded chunk/event records into completed groups and says which records are done."""

    def __init__(self, max_done: int = 200_000) -> None:
        self._groups: dict[str, _Group] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._max_done = max_done
        self._finished: list[Position] = []

    # ------------------------------------------------------------------ feeding

    def knows(self, group_id: str) -> bool:
        """True when the group is being assembled or already done here."""
        return group_id in self._groups or group_id in self._done

    def mark_done(self, group_id: str) -> None:
        """The group was decided elsewhere (e.g. before a crash): its records are duplicates from now on."""
        self._done[group_id] = None
        self._done.move_to_end(group_id)
        while len(self._done) > self._max_done:
            self._done.popitem(last=False)

    def add(self, pos: Position, record: Record, now: float = 0.0) -> CompletedGroup | None:
        """Fold one record; returns the group the first time it becomes complete."""
        group_id = getattr(record, "group_id", None)
        if not isinstance(record, Chunk | GroupDispatched | SessionFinished | SessionRejected) or group_id is None:
            self._finished.append(pos)
            return None
        if group_id in self._done:
            self._finished.append(pos)
            return None
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _Group()
        group.positions.append(pos)
        group.last_seen = now
        if isinstance(record, Chunk):
            session = group.session(record.session_id)
            held = session.chunks.setdefault(record.seq, record)
            if held is not record and held.model_copy(update={"ts": record.ts}) != record:
                session.conflict = True
        elif isinstance(record, GroupDispatched):
            if group.dispatched is None:
                group.dispatched = record
        else:
            session = group.session(record.session_id)
            if session.end is None:
                session.end = record
        if not group.emitted and group.complete():
            group.emitted = True
            return build_group(group)
        return None

    # ------------------------------------------------------------------ lifecycle

    def release(self, group_id: str) -> None:
        """The group's outputs are durable: its records are done, its id is remembered as done."""
        group = self._groups.pop(group_id, None)
        if group is not None:
            self._finished.extend(group.positions)
        self.mark_done(group_id)

    def expire(self, now: float, timeout_s: float) -> Expired:
        """Groups with no record for ``timeout_s``: end them so they stop holding commits.

        A dispatched group is completed as failed (each session without a whole end is
        rejected as ``incomplete``, keeping its contiguous chunks), so the shell decides it
        and its prompt is retried: its agent died before the proxy saw it, or stopped
        calling. A group without its ``GroupDispatched`` cannot be built and is dropped.
        """
        stale = [gid for gid, g in self._groups.items() if not g.emitted and now - g.last_seen > timeout_s]
        expired = Expired()
        for gid in stale:
            group = self._groups[gid]
            if group.dispatched is None:
                self.release(gid)
                expired.dropped.append(gid)
                continue
            for sid in group.dispatched.session_ids:
                session = group.session(sid)
                if not session.complete():
                    session.end = SessionRejected(
                        session_id=sid, group_id=gid, error=INCOMPLETE, num_chunks=None,
                        detail={"idle_s": round(now - group.last_seen, 1), "had_end": session.end is not None},
                    )
            group.emitted = True
            expired.failed.append(build_group(group))
        return expired

    def touch(self, now: float) -> None:
        """Restart every group's incomplete timeout: time the shell could not read records does not count."""
        for group in self._groups.values():
            group.last_seen = max(group.last_seen, now)

    def forget_partitions(self, tps: Iterable[TopicPartition]) -> list[str]:
        """Partitions were revoked: drop every unreleased group with a record there.

        Its records are re-delivered from the committed offset to the partition's next
        owner (this replica too, when the partition comes back), which rebuilds it."""
        lost = set(tps)
        gone = [gid for gid, g in self._groups.items() if any(p.tp in lost for p in g.positions)]
        for gid in gone:
            del self._groups[gid]
        self._finished = [p for p in self._finished if p.tp not in lost]
        return gone

    def take_done(self) -> list[Position]:
        """Positions whose work is done since the last call (for the consumer's offsets)."""
        done, self._finished = self._finished, []
        return done

    @property
    def assembling(self) -> int:
        """Groups seen but not yet released."""
        return len(self._groups)


# --------------------------------------------------------------------------- staleness metrics (pure)

PARTIAL_ROLLOUT_STALENESS = "partial_rollout_staleness_exceeded"
"""The proxy's error name for a session that would span more than ``max_preempts + 1`` versions."""


def trajectory_version_span(trajectory: Trajectory) -> int:
    """Distinct real versions over all tokens of a trajectory (context tokens carry none)."""
    return len({v for seg in trajectory.segments for v in seg.versions if v is not None})


def version_spans(group: CompletedGroup) -> list[int]:
    """Version span of each trajectory of a completed, non-failed group.

    Failed groups give nothing (they never reach training); trajectories without any real
    version (an unlabelled engine) give nothing either, so a span is always >= 1.
    """
    if group.failed:
        return []
    return [span for span in map(trajectory_version_span, group.trajectories) if span > 0]


def partial_rollout_rejected_samples(group: CompletedGroup) -> int:
    """Trajectories of ``group`` when it failed with a session rejected for partial-rollout staleness, else 0."""
    if not group.failed:
        return 0
    hit = any(t.status == "rejected" and t.error == PARTIAL_ROLLOUT_STALENESS for t in group.trajectories)
    return len(group.trajectories) if hit else 0


@dataclass(frozen=True)
class SpanStats:
    min: int
    max: int
    mean: float


class RecentSpans:
    """Version spans of the last ``size`` trajectories: what the span gauges show."""

    def __init__(self, size: int = 1024) -> None:
        self._spans: deque[int] = deque(maxlen=size)

    def add(self, spans: Iterable[int]) -> None:
        self._spans.extend(spans)

    def stats(self) -> SpanStats | None:
        if not self._spans:
            return None
        return SpanStats(min(self._spans), max(self._spans), sum(self._spans) / len(self._spans))


class SeenOnce:
    """A bounded set that says whether a key is new (oldest keys are forgotten first)."""

    def __init__(self, size: int = 100_000) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._size = size

    def add(self, key: str) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        while len(self._keys) > self._size:
            self._keys.popitem(last=False)
        return True
