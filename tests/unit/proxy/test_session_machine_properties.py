"""Properties of the session machine over any order of calls, preempts, failures and ends.

A small in-memory shell drives the machine the way ``ProxyService`` does (publish what an
event says, feed back the ack or the failure, carry out the step) against a broker that
keeps what it acked; hypothesis draws the conversation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from services.proxy.engine_client import EngineOutput, FinishReason
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import Session, Step, VersionRules
from shared.errors import (
    EngineUnavailable,
    GenerationPreempted,
    KafkaUnavailable,
    SessionConflict,
)
from shared.schemas import Chunk, Record, SessionFinished, SessionRejected
from shared.tokenizer import TOKENIZER as TOK

Fault = Literal["none", "engine", "kafka", "cancel"]


class Cancelled(BaseException):
    """Stands for asyncio.CancelledError (a BaseException the shell does not await on)."""


@dataclass(frozen=True)
class Piece:
    """One engine call of a chat call."""

    version: str
    tokens: int
    reason: FinishReason
    fault: Fault
    """What goes wrong at this engine call: before it (engine, cancel) or at its publish (kafka)."""


@dataclass(frozen=True)
class Call:
    extend: bool
    pieces: tuple[Piece, ...]
    soft: bool
    rejection_lost: bool
    """Kafka refuses the SessionRejected this call may publish."""


@dataclass(frozen=True)
class End:
    kind: Literal["finish", "expire"]
    kafka_down: bool


@dataclass
class Shell:
    session: Session
    broker: list[Record]
    history: list[tuple[str, str]]

    def publish(self, records: tuple[Record, ...], down: bool) -> None:
        if records and down:
            raise KafkaUnavailable("broker down")
        self.broker.extend(records)

    def chat(self, call: Call) -> None:
        s = self.session
        user = ("user", str(len(self.broker) % 7))
        messages = [*self.history, user] if call.extend and self.history else [user]
        try:
            plan = s.begin([{"role": role, "content": content} for role, content in messages])
            outputs: list[ChunkOutcome] = []
            for index, piece in enumerate(call.pieces):
                _raise(s.check_engine(piece.version))
                if piece.fault == "engine":
                    raise EngineUnavailable("engine gone")
                if piece.fault == "cancel":
                    raise Cancelled
                ids = [TOK.token_id(str(i % 30)) for i in range(piece.tokens)]
                ids += [TOK.end_id] if piece.reason == "stop" else []
                out = EngineOutput(f"r{index}", ids, [-0.1] * len(ids), piece.version, [piece.version] * len(ids),
                                   piece.reason)
                outcome = ChunkOutcome(index, plan.context_ids if index == 0 else (), out)
                self.publish(s.chunk(outcome, "e"), down=piece.fault == "kafka")
                _raise(s.chunk_acked())
                outputs.append(outcome)
                if piece.reason != "abort":
                    break
                if not s.rules.partial_rollout:
                    raise GenerationPreempted("preempted")
            else:
                raise EngineUnavailable("aborted every time")
            gen = Generation(output_ids=[t for o in outputs for t in o.output.output_ids],
                             finish_reason=outputs[-1].output.finish_reason, chunks=outputs)
            answer = s.complete(gen)
            self.history = [*messages, ("assistant", answer.content)]
        except SessionConflict:
            return
        except Exception as exc:
            self.carry_out(s.fail(exc, soft=call.soft), down=call.rejection_lost)
        except Cancelled:
            self.carry_out(s.cancel(), down=False)

    def carry_out(self, step: Step, down: bool) -> None:
        with contextlib.suppress(KafkaUnavailable):  # required or not, the session ended when the machine said so
            self.publish(step.publish, down=down)

    def end(self, end: End) -> None:
        s = self.session
        try:
            step = s.finish(1.0, "completed") if end.kind == "finish" else s.expire(10.0)
        except SessionConflict:
            return
        try:
            self.publish(step.publish, down=end.kafka_down)
        except KafkaUnavailable:
            return
        s.end_acked()


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


pieces = st.builds(
    Piece,
    version=st.sampled_from(["v1", "v2", "v3"]),
    tokens=st.integers(0, 3),
    reason=st.sampled_from(["stop", "length", "abort", "abort"]),
    fault=st.sampled_from(["none", "none", "none", "none", "engine", "kafka", "cancel"]),
)
calls = st.builds(Call, extend=st.booleans(), pieces=st.lists(pieces, min_size=1, max_size=4).map(tuple),
                  soft=st.booleans(), rejection_lost=st.booleans())
ends = st.builds(End, kind=st.sampled_from(["finish", "expire"]), kafka_down=st.booleans())
programs = st.lists(st.one_of(calls, calls, calls, ends), max_size=8)
rules = st.builds(VersionRules, partial_rollout=st.booleans(), max_preempts=st.sampled_from([None, 0, 1]))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(program=programs, rules=rules, tracked=st.booleans())
def test_whatever_happens_the_records_stay_consistent(
    program: list[Call | End], rules: VersionRules, tracked: bool
) -> None:
    shell = Shell(Session("s", "g" if tracked else "", rules=rules), [], [])
    for step in program:
        shell.chat(step) if isinstance(step, Call) else shell.end(step)
    s, broker = shell.session, shell.broker

    if not tracked:
        assert broker == []
        return
    chunks = [r for r in broker if isinstance(r, Chunk)]
    # Chunk seqs are 0, 1, 2, ... in publish order, each segment's a contiguous run, segments in order.
    assert [c.seq for c in chunks] == list(range(len(chunks))) == list(range(s.num_chunks))
    assert [c.segment_index for c in chunks] == sorted(c.segment_index for c in chunks)
    # Each segment on Kafka rebuilds the session's segment exactly; context only on a call's first chunk.
    for seg in s.segments:
        mine = [c for c in chunks if c.segment_index == seg.index]
        assert [t for c in mine for t in (*c.context_ids, *c.output_ids)] == seg.token_ids
        assert all(bool(c.context_ids) == (c.chunk_index == 0) for c in mine)
    # Nothing follows an end record, and it counts every chunk before it.
    ends_at = [i for i, r in enumerate(broker) if isinstance(r, SessionFinished | SessionRejected)]
    assert ends_at in ([], [len(broker) - 1])
    if ends_at:
        end = broker[-1]
        assert isinstance(end, SessionFinished | SessionRejected)
        assert end.num_chunks == len(chunks) and s.phase in ("finished", "rejected")
        assert (s.phase == "finished") == isinstance(end, SessionFinished)
    # An ended session refuses everything the agent can ask for.
    if s.phase in ("finished", "rejected"):
        before = list(broker)
        shell.end(End("finish", kafka_down=False))
        shell.end(End("expire", kafka_down=False))
        shell.chat(Call(extend=True, pieces=(Piece("v1", 1, "stop", "none"),), soft=False, rejection_lost=False))
        assert broker == before and s.phase in ("finished", "rejected")
    else:
        assert s.phase == "open"  # no call is left half-way
