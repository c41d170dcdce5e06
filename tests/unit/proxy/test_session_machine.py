"""The session state machine as a table: a script of events in, what each one answers out.

Each event's answer is written as one short line (``publish chunk#0/s0/c0``, ``end rejected (x)``,
``raise engine_unavailable``...), so a row reads as the conversation it models.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.proxy.engine_client import EngineOutput, FinishReason
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import Session, Step, VersionRules
from shared.errors import (
    EngineLost,
    EngineUnavailable,
    GenerationPreempted,
    KafkaUnavailable,
    ReinError,
    RolloutRejected,
)
from shared.schemas import Chunk, Record, SessionFinished, SessionRejected
from shared.tokenizer import TOKENIZER as TOK

USER1 = ("user", "guess")
USER2 = ("user", "higher")
FIVE = TOK.token_id("5")


@dataclass
class Driver:
    """Turns script events into session events, remembering what one call needs."""

    session: Session
    outputs: list[EngineOutput] | None = None
    messages: list[tuple[str, str]] | None = None
    plan_context: tuple[int, ...] = ()
    rejection: RolloutRejected | None = None
    """The last rejection ``check`` or ``sent`` answered: ``("fail", "it")`` feeds it back."""
    refused: ReinError | None = None
    """The last error an event raised: ``("fail", "refused")`` feeds it back."""

    def event(self, event: tuple[object, ...]) -> str:
        try:
            return self._event(event)
        except ReinError as exc:
            self.refused = exc
            return f"refused {exc.code}"

    def _event(self, event: tuple[object, ...]) -> str:
        s, name, args = self.session, event[0], event[1:]
        if name == "begin":  # ("begin", "extend" | "rewrite" | "bad")
            self.messages = {"rewrite": [USER2], "bad": [("tool", "x")]}.get(str(args[0]), [USER1])
            if args[0] == "extend":
                self.messages = [USER1, ("assistant", "5"), USER2]
            plan = s.begin([{"role": role, "content": content} for role, content in self.messages], "t")
            self.outputs, self.plan_context = [], plan.context_ids
            return f"plan s{plan.segment_index} {'new' if plan.new_segment else 'extend'}"
        if name == "check":  # ("check", version)
            self.rejection = s.check_engine(str(args[0]))
            return _rejection(self.rejection)
        if name == "chunk":  # ("chunk", version, finish_reason)
            assert self.outputs is not None
            reason: FinishReason = args[1]  # type: ignore[assignment]
            ids = [FIVE, TOK.end_id] if reason == "stop" else [FIVE]
            out = EngineOutput(f"r{len(self.outputs)}", ids, [-0.1] * len(ids), str(args[0]), [str(args[0])] * len(ids),
                               reason)
            index = len(self.outputs)
            self.outputs.append(out)
            records = s.chunk(ChunkOutcome(index, self.plan_context if index == 0 else (), out), "e")
            return "publish " + (" ".join(_record(r) for r in records) or "-")
        if name == "sent":
            self.rejection = s.chunk_sent()
            return _rejection(self.rejection)
        if name == "lost":  # ("lost", seq): Kafka refused that chunk
            s.chunk_lost(int(args[0]), KAFKA)  # type: ignore[call-overload]
            return "-"
        if name == "complete":
            assert self.outputs is not None
            ids = [t for o in self.outputs for t in o.output_ids]
            gen = Generation(output_ids=ids, finish_reason=self.outputs[-1].finish_reason if self.outputs else "stop",
                             chunks=[ChunkOutcome(i, (), o) for i, o in enumerate(self.outputs)])
            answer = s.complete(gen)
            return f"answer {answer.content!r} {answer.finish_reason}"
        if name == "fail":  # ("fail", error | "it" | "refused", soft)
            error = {"it": self.rejection, "refused": self.refused}.get(args[0], args[0])  # type: ignore[call-overload]
            assert isinstance(error, Exception)
            return _step(s.fail(error, soft=bool(args[1:] and args[1])))
        if name == "cancel":
            return _step(s.cancel())
        if name == "finish":
            return _step(s.finish(1.0, "completed"))
        if name == "expire":
            return _step(s.expire(30.0))
        if name == "end":
            return _step(s.end_acked())
        raise AssertionError(name)


def _rejection(error: RolloutRejected | None) -> str:
    return "ok" if error is None else f"reject {error.code}"


def _record(record: Record) -> str:
    if isinstance(record, Chunk):
        return f"chunk#{record.seq}/s{record.segment_index}/c{record.chunk_index}"
    if isinstance(record, SessionRejected):
        return f"rejected({record.error},n={record.num_chunks})"
    assert isinstance(record, SessionFinished)
    return f"finished(n={record.num_chunks})"


def _step(step: Step) -> str:
    parts = []
    if step.ended:
        parts.append(f"end {step.ended}")
    if step.publish:
        parts.append("publish " + " ".join(_record(r) for r in step.publish) + ("" if step.required else "?"))
    if step.answer is not None:
        parts.append("answer soft")
    if step.error is not None:
        parts.append(f"raise {getattr(step.error, 'code', type(step.error).__name__)}")
    return ", ".join(parts) or "-"


KAFKA = KafkaUnavailable("broker down")
LOST_N = "kafka_unavailable"
LOST = EngineUnavailable("engine gone")
GONE = EngineLost("the session's engine failed its health checks")
SPAN = "partial_rollout_staleness_exceeded"
FIRST_TURN: list[tuple[tuple[object, ...], str]] = [
    (("begin", "first"), "plan s0 new"), (("check", "v1"), "ok"), (("chunk", "v1", "stop"), "publish chunk#0/s0/c0"),
    (("sent",), "ok"), (("complete",), "answer '5' stop"),
]

TABLE: dict[str, tuple[VersionRules, str, list[tuple[tuple[object, ...], str]]]] = {
    "one turn, then an extension": (VersionRules(), "g", [
        *FIRST_TURN,
        (("begin", "extend"), "plan s0 extend"), (("chunk", "v1", "stop"), "publish chunk#1/s0/c0"), (("sent",), "ok"),
    ]),
    "an untracked session publishes nothing, ever": (VersionRules(), "", [
        *[(e, "publish -" if e[0] == "chunk" else r) for e, r in FIRST_TURN],
        (("begin", "extend"), "plan s0 extend"), (("chunk", "v1", "abort"), "publish -"), (("sent",), "ok"),
        (("fail", LOST), "end rejected (engine_unavailable), raise engine_unavailable"),
        (("finish",), "refused session_finalized"),
    ]),
    "a preempted chunk continues on the new version within the cap": (VersionRules(max_preempts=1), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("check", "v2"), "ok"), (("chunk", "v2", "stop"), "publish chunk#1/s0/c1"), (("sent",), "ok"),
        (("complete",), "answer '5 5' stop"),
    ]),
    "the span pre-check rejects before spending compute": (VersionRules(max_preempts=0), "g", [
        *FIRST_TURN, (("begin", "extend"), "plan s0 extend"), (("check", "v2"), f"reject {SPAN}"),
        (("fail", "it"), f"end rejected ({SPAN}), publish rejected({SPAN},n=1), raise {SPAN}"),
        (("finish",), "refused session_finalized"), (("begin", "extend"), "refused session_finalized"),
    ]),
    "the post-check rejects after the chunk is on record": (VersionRules(max_preempts=0), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("chunk", "v2", "stop"), "publish chunk#1/s0/c1"), (("sent",), f"reject {SPAN}"),
        (("fail", "it"), f"end rejected ({SPAN}), publish rejected({SPAN},n=2), raise {SPAN}"),
    ]),
    "a soft rejection answers 200 and still ends the session": (VersionRules(max_preempts=0), "g", [
        *FIRST_TURN, (("begin", "extend"), "plan s0 extend"), (("check", "v2"), f"reject {SPAN}"),
        (("fail", "it", True), f"end rejected ({SPAN}), publish rejected({SPAN},n=1), answer soft"),
        (("expire",), "refused session_finalized"),
    ]),
    "without partial rollout a new version ends the trajectory": (VersionRules(partial_rollout=False), "g", [
        *FIRST_TURN, (("begin", "rewrite"), "plan s1 new"), (("check", "v1"), "ok"),
        (("check", "v2"), "reject trajectory_version_changed"),
    ]),
    "without partial rollout a preempt rejects the session": (VersionRules(partial_rollout=False), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("fail", GenerationPreempted("preempted")),
         "end rejected (generation_preempted), publish rejected(generation_preempted,n=1), raise generation_preempted"),
    ]),
    "an engine lost before any chunk leaves the session open and the segment extendable": (VersionRules(), "g", [
        *FIRST_TURN, (("begin", "extend"), "plan s0 extend"), (("fail", LOST), "raise engine_unavailable"),
        (("begin", "extend"), "plan s0 extend"),
    ]),
    "an engine lost after a chunk rejects the session, best effort": (VersionRules(), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("fail", LOST),
         "end rejected (engine_unavailable), publish rejected(engine_unavailable,n=1)?, raise engine_unavailable"),
    ]),
    "the engine holding a session's tokens lost between calls rejects it on record": (VersionRules(), "g", [
        *FIRST_TURN, (("begin", "extend"), "plan s0 extend"),
        (("fail", GONE), "end rejected (engine_lost), publish rejected(engine_lost,n=1)?, raise engine_lost"),
        (("finish",), "refused session_finalized"),
    ]),
    "a session without tokens whose engine is lost stays open (it starts elsewhere)": (VersionRules(), "g", [
        (("begin", "first"), "plan s0 new"), (("fail", GONE), "raise engine_lost"), (("begin", "first"), "plan s0 new"),
    ]),
    "a plain bug after a chunk is rejected as internal_error and re-raised as is": (VersionRules(), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("fail", KeyError("x")),
         "end rejected (internal_error), publish rejected(internal_error,n=1)?, raise KeyError"),
    ]),
    "Kafka refusing to take an extension's first chunk closes the segment": (VersionRules(), "g", [
        *FIRST_TURN, (("begin", "extend"), "plan s0 extend"), (("chunk", "v1", "stop"), "publish chunk#1/s0/c0"),
        (("fail", KAFKA), "raise kafka_unavailable"), (("begin", "extend"), "plan s1 new"),
        (("chunk", "v1", "stop"), "publish chunk#1/s1/c0"),
    ]),
    "Kafka refusing to take a later chunk rejects with the chunks that made it": (VersionRules(), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("chunk", "v1", "stop"), "publish chunk#1/s0/c1"),
        (("fail", KAFKA),
         "end rejected (kafka_unavailable), publish rejected(kafka_unavailable,n=1)?, raise kafka_unavailable"),
    ]),
    "a bad role is a 400 and changes nothing": (VersionRules(), "g", [
        (("begin", "bad"), "refused invalid_request"), (("begin", "first"), "plan s0 new"),
    ]),
    "a cancelled call ends the session only once it published": (VersionRules(), "g", [
        (("begin", "first"), "plan s0 new"), (("cancel",), "-"), (("begin", "first"), "plan s0 new"),
        (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("cancel",), "end rejected (cancelled)"),
        (("finish",), "refused session_finalized"),
    ]),
    "finish publishes every chunk's count and ends at the ack": (VersionRules(), "g", [
        *FIRST_TURN, (("finish",), "publish finished(n=1)"), (("end",), "end finished"),
        (("finish",), "refused session_finalized"), (("begin", "extend"), "refused session_finalized"),
    ]),
    "a finish Kafka refused leaves the session open": (VersionRules(), "g", [
        *FIRST_TURN, (("finish",), "publish finished(n=1)"), (("begin", "extend"), "plan s0 extend"),
    ]),
    "finish during a call is refused": (VersionRules(), "g", [
        (("begin", "first"), "plan s0 new"), (("finish",), "refused session_busy"),
        (("expire",), "refused session_busy"),
    ]),
    "an idle session is rejected once its record is on Kafka": (VersionRules(), "g", [
        *FIRST_TURN, (("expire",), "publish rejected(session_idle,n=1)"), (("end",), "end rejected (session_idle)"),
        (("finish",), "refused session_finalized"),
    ]),
    "a lost chunk refuses the next call and rejects with the chunks before it": (VersionRules(), "g", [
        *FIRST_TURN, (("begin", "extend"), "plan s0 extend"), (("chunk", "v1", "stop"), "publish chunk#1/s0/c0"),
        (("sent",), "ok"), (("complete",), "answer '5' stop"), (("lost", 1), "-"),
        (("begin", "extend"), f"refused {LOST_N}"),
        (("fail", "refused"), f"end rejected ({LOST_N}), publish rejected({LOST_N},n=1)?, raise {LOST_N}"),
        (("finish",), "refused session_finalized"),
    ]),
    "finish after a lost chunk rejects instead of finishing": (VersionRules(), "g", [
        *FIRST_TURN, (("lost", 0), "-"),
        (("finish",), f"end rejected ({LOST_N}), publish rejected({LOST_N},n=0)?, raise {LOST_N}"),
        (("begin", "extend"), "refused session_finalized"),
    ]),
    "chunks lost during a call count from the first one lost": (VersionRules(), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("chunk", "v1", "abort"), "publish chunk#1/s0/c1"), (("sent",), "ok"), (("lost", 1), "-"), (("lost", 0), "-"),
        (("lost", 1), "-"),
        (("fail", LOST), f"end rejected ({LOST_N}), publish rejected({LOST_N},n=0)?, raise engine_unavailable"),
    ]),
    "a staleness rejection after a lost chunk stays required and counts what is on Kafka":
        (VersionRules(max_preempts=0), "g", [
        (("begin", "first"), "plan s0 new"), (("chunk", "v1", "abort"), "publish chunk#0/s0/c0"), (("sent",), "ok"),
        (("lost", 0), "-"), (("chunk", "v2", "stop"), "publish chunk#1/s0/c1"), (("sent",), f"reject {SPAN}"),
        (("fail", "it"), f"end rejected ({SPAN}), publish rejected({SPAN},n=0), raise {SPAN}"),
    ]),
    "an idle session with a lost chunk is rejected with the chunks on Kafka": (VersionRules(), "g", [
        *FIRST_TURN, (("begin", "extend"), "plan s0 extend"), (("chunk", "v1", "stop"), "publish chunk#1/s0/c0"),
        (("sent",), "ok"), (("complete",), "answer '5' stop"), (("lost", 1), "-"),
        (("expire",), "publish rejected(session_idle,n=1)"), (("end",), "end rejected (session_idle)"),
        (("lost", 0), "-"),
    ]),
    "an untracked session finishes without a record": (VersionRules(), "", [
        *[(e, "publish -" if e[0] == "chunk" else r) for e, r in FIRST_TURN],
        (("finish",), "-"), (("end",), "end finished"),
    ]),
}


@pytest.mark.parametrize("rules,group,script", TABLE.values(), ids=TABLE.keys())
def test_session_machine(rules: VersionRules, group: str, script: list[tuple[tuple[object, ...], str]]) -> None:
    driver = Driver(Session("s", group, rules=rules))
    assert [driver.event(event) for event, _ in script] == [expected for _, expected in script]


@pytest.mark.parametrize("event", [("chunk", "v1", "stop"), ("sent",), ("complete",), ("end",)])
def test_events_out_of_order_are_bugs_not_answers(event: tuple[object, ...]) -> None:
    driver = Driver(Session("s", "g"), outputs=[])
    with pytest.raises(RuntimeError):
        driver.event(event)


@pytest.mark.parametrize(
    ("words", "finish", "stop", "content", "matched"),
    [
        (["5", "7", "8"], "stop", ("7",), "5 ", "7"),  # the stop string and what follows it are left out
        (["5", "7", "8"], "stop", ("8", "7 8"), "5 ", "7 8"),  # the earliest occurrence wins
        (["5", "7"], "stop", ("9",), "5 7", None),  # an end id stopped it: nothing to cut
        (["5", "7"], "length", ("7",), "5 7", None),  # cut by its budget: the engine did not stop on it
    ],
)
def test_the_answer_ends_before_the_stop_string_and_the_ids_keep_it(
    words: list[str], finish: FinishReason, stop: tuple[str, ...], content: str, matched: str | None
) -> None:
    s = Session("s", "g")
    plan = s.begin([{"role": "user", "content": "guess"}], "t")
    ids = [TOK.token_id(w) for w in words]
    out = EngineOutput("r0", ids, [-0.1] * len(ids), "v1", ["v1"] * len(ids), finish)
    s.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
    s.chunk_sent()
    answer = s.complete(Generation(output_ids=ids, finish_reason=finish, chunks=[]), stop=stop)
    assert answer.content == content and answer.rein["output_ids"] == ids
    assert answer.stop_sequence == matched, "which stop string it ended at (Messages answers it)"
    assert s.current is not None and s.current.answers[-1].text == TOK.decode(ids), "what the next turn continues"
