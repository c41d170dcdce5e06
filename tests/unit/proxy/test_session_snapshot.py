"""A session snapshotted between calls and restored elsewhere continues exactly as the original would have.

Hypothesis draws a conversation (calls that extend the history or rewrite it, each with one or more
engine chunks of some versions, a tool call now and then) and the call after which the session's proxy
dies. One session runs the whole conversation; another runs it up to that call, goes through
``snapshot`` → JSON → ``restore`` (as another replica reads it), and runs the rest. Both must publish the
same chunk records (seq, segment, context and output ids, versions) and end in the same state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.proxy.engine_client import EngineOutput
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import Session
from services.proxy.session_snapshot import FORMAT, UnreadableSnapshot, restore, snapshot
from services.proxy.sessions import SessionStore
from shared.schemas import Chunk
from shared.tokenizer import TOKENIZER as TOK

WORDS = ["higher", "lower", "guess", "5", "7", "12"]


@dataclass(frozen=True)
class Call:
    rewrite: bool
    """The agent sends a history other than the session's (a new segment) instead of extending it."""
    user: str
    pieces: tuple[tuple[str, int], ...]
    """Engine chunks: (version, output tokens); every chunk but the last is preempted (``abort``)."""


calls_st = st.lists(
    st.builds(Call, st.booleans(), st.sampled_from(WORDS),
              st.lists(st.tuples(st.sampled_from(["v1", "v2"]), st.integers(1, 4)), min_size=1, max_size=3
                       ).map(tuple)),
    min_size=1, max_size=5,
)


def _run(session: Session, calls: list[Call], history: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """Drive ``calls[start:]`` as the proxy's shell does; returns the chunk records, as dicts."""
    records: list[dict[str, Any]] = []
    for n, call in enumerate(calls[start:], start):
        if call.rewrite:
            history[:] = [{"role": "user", "content": f"again {n}"}]
        history.append({"role": "user", "content": call.user})
        plan = session.begin(list(history), f"t{n}")
        outputs = []
        for i, (version, tokens) in enumerate(call.pieces):
            last = i == len(call.pieces) - 1
            ids = [TOK.token_id(WORDS[(n + i + k) % 4]) for k in range(tokens)] + ([TOK.end_id] if last else [])
            out = EngineOutput(f"r{n}.{i}", ids, [-0.5] * len(ids), version, [version] * len(ids),
                               "stop" if last else "abort")
            outputs.append(out)
            for record in session.chunk(ChunkOutcome(i, plan.context_ids if i == 0 else (), out), "engine-0"):
                assert isinstance(record, Chunk)
                records.append(record.model_dump(exclude={"rid", "ts"}))
            assert session.chunk_sent() is None
        gen = Generation(output_ids=[t for o in outputs for t in o.output_ids], finish_reason="stop",
                         chunks=[ChunkOutcome(i, (), o) for i, o in enumerate(outputs)])
        answer = session.complete(gen)
        history.append({"role": "assistant", "content": answer.content})
    return records


@settings(max_examples=150, deadline=None)
@given(calls=calls_st, data=st.data())
def test_a_restored_session_continues_as_the_original(calls: list[Call], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(calls)), label="calls before the proxy dies")
    original = Session(session_id="s", group_id="g", prompt_id="p", attempt=1)
    whole = _run(original, calls, [], 0)

    first = Session(session_id="s", group_id="g", prompt_id="p", attempt=1)
    first.engine = "engine-0"
    history: list[dict[str, Any]] = []
    before = _run(first, calls[:cut], history, 0)
    wire = json.loads(json.dumps(snapshot(first)))  # what another replica reads from Redis
    continued = restore(wire, Session(session_id="", group_id=""))
    assert continued.engine == "engine-0"
    after = _run(continued, calls, history, cut)

    assert before + after == whole
    assert snapshot(continued) == snapshot(original) | {"engine": "engine-0"}


def test_only_an_open_session_with_every_chunk_written_is_snapshotted() -> None:
    session = Session(session_id="s", group_id="g")
    session.begin([{"role": "user", "content": "guess"}])
    with pytest.raises(ValueError, match="in_call"):
        snapshot(session)


@pytest.mark.parametrize("change", [
    {"format": FORMAT + 1}, {"segments": "x"}, {"num_chunks": None},
    {"segments": [{"index": 0, "token_ids": [1, 2], "versions": [[None, 1]], "turns": [[1, 1]], "open": True,
                   "tools": [], "messages": [], "answers": []}]},
])
def test_a_snapshot_that_cannot_be_read_is_refused(change: dict[str, Any]) -> None:
    data = snapshot(Session(session_id="s", group_id="g")) | change
    with pytest.raises(UnreadableSnapshot):
        restore(data, Session(session_id="", group_id=""))


def test_the_store_adopts_a_session_it_does_not_know() -> None:
    store = SessionStore()
    original = Session(session_id="s", group_id="g")
    _run(original, [Call(False, "guess", (("v1", 2),))], [], 0)
    assert not store.holds("s")
    adopted = store.adopt(snapshot(original))
    assert store.holds("s") and adopted.num_chunks == 1
    with pytest.raises(ValueError, match="known here"):
        store.adopt(snapshot(original))
    assert store.acquire("s", "g") is adopted
