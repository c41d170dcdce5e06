"""A session between calls as plain data, and back: what another proxy replica needs to continue it.

A session lives in one proxy's memory. When that proxy dies, the agent's next call reaches another
replica (the balancer moves only the dead one's sessions); with the snapshot of the session after its
last call that replica continues it token-exact: the same segments, ids, per-token versions, turns
and answers, so the next call appends only the chat template's delta, and its chunks number on from
the last ``seq``. Pure: :mod:`services.proxy.handoff` stores and fences the snapshots.

Only an open session whose every chunk is on Kafka is snapshotted (``lost`` is None, no call in
flight): a session with a chunk Kafka refused can never be whole, and one taken in the middle of a
call would number chunks the dead proxy may already have written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.proxy.session_machine import Session
from services.proxy.transcript import Answer, Call, SegmentState
from shared.versions import decode_runs, encode_runs

FORMAT = 1
"""Bumped when the layout changes: a replica refuses a snapshot of another format (the session is then
lost as if no snapshot were kept, never continued from a misread one)."""


class UnreadableSnapshot(ValueError):
    """Not a snapshot this proxy can continue (another format, or a field missing or of the wrong type)."""


def snapshot(session: Session) -> dict[str, Any]:
    """``session`` (open, no call in flight, no chunk lost) as JSON-ready data, copied: later calls do not
    change it."""
    if session.phase != "open" or session.lost is not None:
        raise ValueError(f"session {session.session_id} is {session.phase}, lost chunk {session.lost}: "
                         "only an open session with every chunk written is continued elsewhere")
    return {
        "format": FORMAT,
        "session_id": session.session_id,
        "group_id": session.group_id,
        "prompt_id": session.prompt_id,
        "attempt": session.attempt,
        "engine": session.engine,
        "num_chunks": session.num_chunks,
        "segments": [_segment(seg) for seg in session.segments],
    }


def _segment(seg: SegmentState) -> dict[str, Any]:
    return {
        "index": seg.index,
        "token_ids": list(seg.token_ids),
        "versions": [[label, count] for label, count in encode_runs(seg.versions)],
        "turns": [[len(context), len(sampled)] for context, sampled in seg.turns],
        "open": seg.open,
        "tools": [dict(tool) for tool in seg.last_call.tools],
        "messages": [dict(message) for message in seg.last_call.messages],
        "answers": [{"message": dict(a.message), "text": a.text} for a in seg.answers],
    }


def restore(data: Mapping[str, Any], template: Session) -> Session:
    """The session ``data`` stands for, served as ``template`` says (tokenizer, version rules, tool-call
    format, rewritten-history rule: this replica's settings, the same in every replica).
    Raises :class:`UnreadableSnapshot` for anything else than what :func:`snapshot` wrote."""
    try:
        if data["format"] != FORMAT:
            raise UnreadableSnapshot(f"snapshot format {data['format']!r}, this proxy reads {FORMAT}")
        session = Session(
            session_id=str(data["session_id"]), group_id=str(data["group_id"]), prompt_id=str(data["prompt_id"]),
            attempt=int(data["attempt"]), tokenizer=template.tokenizer, rules=template.rules,
            tool_calls=template.tool_calls, rewritten_history=template.rewritten_history,
        )
        session.engine = str(data["engine"])
        session.num_chunks = int(data["num_chunks"])
        session.segments = [_read_segment(seg) for seg in data["segments"]]
    except UnreadableSnapshot:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableSnapshot(f"not a session snapshot: {type(exc).__name__}: {exc}") from None
    return session


def _read_segment(data: Mapping[str, Any]) -> SegmentState:
    token_ids = [int(t) for t in data["token_ids"]]
    versions: list[str | None] = decode_runs((None if label is None else str(label), int(count))
                                             for label, count in data["versions"])
    turns, at = [], 0
    for context, sampled in data["turns"]:
        turns.append((token_ids[at:at + context], token_ids[at + context:at + context + sampled]))
        at += context + sampled
    if at != len(token_ids) or len(versions) != len(token_ids):
        raise ValueError(f"{len(token_ids)} ids, {len(versions)} versions, turns covering {at}")
    return SegmentState(
        index=int(data["index"]), token_ids=token_ids, versions=versions, turns=turns, open=bool(data["open"]),
        last_call=Call(tools=tuple(data["tools"]), messages=tuple(data["messages"])),
        answers=[Answer(message=a["message"], text=str(a["text"])) for a in data["answers"]],
    )
