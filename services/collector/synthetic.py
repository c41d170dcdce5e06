"""Synthetic proxy/runner output for tests and ``bench/collector.py``: the records one group produces.

A trajectory is described by its chunks, each ``(segment_index, version)`` (or just a
version for segment 0); the records follow the proxy's contract: chunks with a per-session
``seq``, then ``GroupDispatched``/``SessionFinished``/``SessionRejected`` on the events topic.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.schemas import Chunk, GroupDispatched, Record, SessionFinished, SessionRejected

ChunkSpec = str | None | tuple[int, str | None]


def group_records(
    group_id: str,
    trajectories: Sequence[Sequence[ChunkSpec]],
    *,
    prompt_id: str | None = None,
    attempt: int = 0,
    rejected: Sequence[int] = (),
    tokens_per_chunk: int = 4,
    context_per_chunk: int = 2,
    reward: float = 1.0,
    rewards: Sequence[float] | None = None,
    rejected_error: str = "test_rejected",
    free_retries: int = 0,
) -> list[Record]:
    """Dispatch, chunks and end events of one group; trajectory ``i`` in ``rejected`` ends rejected.

    A finished trajectory ``i`` gets ``rewards[i]``, or ``reward`` when ``rewards`` is None (then the
    group's rewards are all equal: it carries no GRPO signal).
    """
    if rewards is not None and len(rewards) != len(trajectories):
        raise ValueError(f"{len(rewards)} rewards for {len(trajectories)} trajectories")
    prompt_id = prompt_id or f"prompt-{group_id}"
    session_ids = [f"{group_id}-s{i}" for i in range(len(trajectories))]
    records: list[Record] = [
        GroupDispatched(
            group_id=group_id, prompt_id=prompt_id, attempt=attempt, free_retries=free_retries,
            session_ids=session_ids, prompt={"id": prompt_id},
        )
    ]
    ends: list[Record] = []
    for i, (sid, chunks) in enumerate(zip(session_ids, trajectories, strict=True)):
        for seq, spec in enumerate(chunks):
            segment, version = spec if isinstance(spec, tuple) else (0, spec)
            records.append(
                Chunk(
                    session_id=sid,
                    group_id=group_id,
                    prompt_id=prompt_id,
                    attempt=attempt,
                    seq=seq,
                    segment_index=segment,
                    chunk_index=0,
                    context_ids=list(range(context_per_chunk)),
                    output_ids=[(seq * 7 + k) % 50_000 for k in range(tokens_per_chunk)],
                    logprobs=[-0.25] * tokens_per_chunk,
                    version=version,
                    finish_reason="stop",
                )
            )
        if i in rejected:
            ends.append(
                SessionRejected(session_id=sid, group_id=group_id, error=rejected_error, num_chunks=len(chunks))
            )
        else:
            got = reward if rewards is None else rewards[i]
            ends.append(SessionFinished(session_id=sid, group_id=group_id, reward=got, num_chunks=len(chunks)))
    return records + ends
