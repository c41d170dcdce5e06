"""Rollout records as the collector's assembler reads them, for its unit tests: chunks, dispatches and
session ends with the fields a test does not care about filled in, the two topics they come from, and
``commits``, what the collector's shell commits after an iteration."""

from __future__ import annotations

from services.collector.assembly import Assembler
from shared.offsets import Offsets
from shared.schemas import Chunk, GroupDispatched, SessionFinished

CHUNKS = "rollout.chunks"
EVENTS = "rollout.events"


def chunk(
    sid: str,
    seq: int,
    *,
    seg: int = 0,
    ctx: list[int] | None = None,
    out: list[int] | None = None,
    version: str | None = "v1",
    gid: str = "g1",
) -> Chunk:
    out = [10 + seq, 20 + seq] if out is None else out
    return Chunk(
        session_id=sid,
        group_id=gid,
        seq=seq,
        segment_index=seg,
        chunk_index=0,
        context_ids=[1, 2] if ctx is None else ctx,
        output_ids=out,
        logprobs=[-0.5] * len(out),
        version=version,
        finish_reason="stop",
    )


def dispatched(sids: list[str], gid: str = "g1", attempt: int = 0) -> GroupDispatched:
    return GroupDispatched(group_id=gid, prompt_id="p1", attempt=attempt, session_ids=sids, prompt={"q": 1})


def finished(sid: str, n: int, gid: str = "g1", reward: float = 1.0, status: str = "completed") -> SessionFinished:
    return SessionFinished(session_id=sid, group_id=gid, reward=reward, num_chunks=n, status=status)  # type: ignore[arg-type]


def commits(asm: Assembler, offsets: Offsets) -> dict[tuple[str, int], int]:
    """What the collector's shell does each iteration: mark the assembler's done positions, read the commit."""
    for pos in asm.take_done():
        offsets.done(pos.tp, pos.offset)
    return offsets.to_commit()
