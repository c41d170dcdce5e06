"""Properties of the session machine over any order of calls, preempts, failures and ends.

A small in-memory shell drives the machine the way ``ProxyService`` does: chunks are
submitted without waiting (a broker that keeps, in submission order, every record it
takes), their refusals are learned later (at the next call, or when an end waits for
every ack) and fed back as ``chunk_lost``; steps are carried out. Hypothesis draws the
conversation and when each chunk's answer comes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.proxy.engine_client import EngineOutput, FinishReason
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import Session, Step, VersionRules
from shared.errors import (
    EngineUnavailable,
    GenerationPreempted,
    KafkaUnavailable,
    RolloutRejected,
    SessionConflict,
)
from shared.schemas import Chunk, Record, SessionFinished, SessionRejected
from shared.tokenizer import TOKENIZER as TOK

Fault = Literal["none", "engine", "kafka", "refuse", "cancel"]


class Cancelled(BaseException):
    """Stands for asyncio.CancelledError (a BaseException the shell does not await on)."""


@dataclass(frozen=True)
class Piece:
    """One engine call of a chat call."""

    version: str
    tokens: int
    reason: FinishReason
    fault: Fault
    """What goes wrong at this engine call: before it (engine, cancel), at its submit (refuse: no
    producer) or at its write (kafka: the ack is a failure)."""
    late: bool
    """The chunk's answer comes only when an end waits for it, not by the session's next call."""


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
    unanswered: list[tuple[int, bool, bool]] = field(default_factory=list)
    """Submitted chunks whose answer the shell has not seen: (seq, written, late)."""

    def publish(self, records: tuple[Record, ...], down: bool) -> None:
        if records and down:
            raise KafkaUnavailable("broker down")
        self.broker.extend(records)

    def submit(self, records: tuple[Record, ...], fault: Fault, late: bool) -> None:
        if records and fault == "refuse":
            raise KafkaUnavailable("no producer")
        for record in records:
            assert isinstance(record, Chunk)
            if fault != "kafka":
                self.broker.append(record)
            self.unanswered.append((record.seq, fault != "kafka", late))

    def look(self, settle: bool) -> None:
        """Feed the refusals answered so far (all of them once ``settle`` waited for every ack)."""
        for item in list(self.unanswered):
            seq, written, late = item
            if settle or not late:
                self.unanswered.remove(item)
                if not written:
                    self.session.chunk_lost(seq, KafkaUnavailable("refused"))

    def chat(self, call: Call) -> None:
        s = self.session
        user = ("user", str(len(self.broker) % 7))
        messages = [*self.history, user] if call.extend and self.history else [user]
        try:
            self.look(settle=False)
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
                self.submit(s.chunk(outcome, "e"), piece.fault, piece.late)
                _raise(s.chunk_sent())
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
        except (RolloutRejected, EngineUnavailable, KafkaUnavailable) as exc:  # what this shell and the machine
            self.look(settle=True)  # refuse with; anything else (a RuntimeError of the machine) fails the property
            self.carry_out(s.fail(exc, soft=call.soft), down=call.rejection_lost)
        except Cancelled:
            self.carry_out(s.cancel(), down=False)

    def carry_out(self, step: Step, down: bool) -> None:
        with contextlib.suppress(KafkaUnavailable):  # required or not, the session ended when the machine said so
            self.publish(step.publish, down=down)

    def end(self, end: End) -> None:
        s = self.session
        self.look(settle=True)
        try:
            step = s.finish(1.0, "completed") if end.kind == "finish" else s.expire(10.0)
        except SessionConflict:
            return
        if step.ended is not None:  # a lost chunk: rejected at once
            self.carry_out(step, down=end.kafka_down)
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
    fault=st.sampled_from(["none", "none", "none", "none", "engine", "kafka", "refuse", "cancel"]),
    late=st.booleans(),
)
calls = st.builds(Call, extend=st.booleans(), pieces=st.lists(pieces, min_size=1, max_size=4).map(tuple),
                  soft=st.booleans(), rejection_lost=st.booleans())
ends = st.builds(End, kind=st.sampled_from(["finish", "expire"]), kafka_down=st.booleans())
programs = st.lists(st.one_of(calls, calls, calls, ends), max_size=8)
rules = st.builds(VersionRules, partial_rollout=st.booleans(), max_preempts=st.sampled_from([None, 0, 1]))


LOST_THEN_FINISH = [Call(False, (Piece("v1", 1, "abort", "none", False), Piece("v1", 1, "stop", "kafka", True)),
                         soft=False, rejection_lost=False), End("finish", kafka_down=False)]
"""A chunk whose refusal comes only while finish waits for the acks (rare in random programs)."""


@settings(max_examples=600, deadline=None, derandomize=True)
@given(program=programs, rules=rules, tracked=st.booleans())
@example(program=LOST_THEN_FINISH, rules=VersionRules(), tracked=True)
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
    seqs = [c.seq for c in chunks]
    # Chunks are on Kafka in submission order, each once; segments in order.
    assert seqs == sorted(set(seqs)) and all(q < s.num_chunks for q in seqs)
    assert [c.segment_index for c in chunks] == sorted(c.segment_index for c in chunks)
    if seqs == list(range(s.num_chunks)):  # none lost: each segment on Kafka rebuilds the session's exactly
        for seg in s.segments:
            mine = [c for c in chunks if c.segment_index == seg.index]
            assert [t for c in mine for t in (*c.context_ids, *c.output_ids)] == seg.token_ids
            assert all(bool(c.context_ids) == (c.chunk_index == 0) for c in mine)
    # Nothing follows an end record, and the chunks it counts (0..n-1) are all on Kafka.
    ends_at = [i for i, r in enumerate(broker) if isinstance(r, SessionFinished | SessionRejected)]
    assert ends_at in ([], [len(broker) - 1])
    if ends_at:
        end = broker[-1]
        assert isinstance(end, SessionFinished | SessionRejected) and end.num_chunks is not None
        assert set(range(end.num_chunks)) <= set(seqs) and s.phase in ("finished", "rejected")
        assert end.num_chunks == s.written
        assert (s.phase == "finished") == isinstance(end, SessionFinished)
        if isinstance(end, SessionFinished):  # finished only when every chunk is on Kafka
            assert s.lost is None and seqs == list(range(s.num_chunks)) == list(range(end.num_chunks))
    # An ended session refuses everything the agent can ask for.
    if s.phase in ("finished", "rejected"):
        before = list(broker)
        shell.end(End("finish", kafka_down=False))
        shell.end(End("expire", kafka_down=False))
        shell.chat(Call(extend=True, pieces=(Piece("v1", 1, "stop", "none", False),), soft=False,
                        rejection_lost=False))
        assert broker == before and s.phase in ("finished", "rejected")
    else:
        assert s.phase == "open"  # no call is left half-way
