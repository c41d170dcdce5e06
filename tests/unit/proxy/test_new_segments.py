"""Why a call starts a new segment: each way an agent's history can stop extending token-exact has its reason.

Calls are played on a real :class:`Session` with the tiny tokenizer (the template the demo
serves), so a reason is only given where the tokenizer itself refused to continue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.proxy.engine_client import EngineOutput, Sampling
from services.proxy.engine_pool import EnginePool
from services.proxy.generation import ChunkOutcome, Generation, PauseController
from services.proxy.metrics import ProxyMetrics
from services.proxy.service import CallIds, ProxyService
from services.proxy.session_machine import Session, TurnPlan
from services.proxy.settings import ProxySettings
from services.proxy.transcript import Call, SegmentState, new_segment_reason
from shared.errors import KafkaUnavailable
from shared.model.base import Turn
from shared.model.tiny_chat import TinyChatTokenizer
from shared.tokenizer import TOKENIZER as TOK

Message = dict[str, Any]
FIVE = [TOK.token_id("5"), TOK.end_id]
"""What the engine samples in every call here: the answer ``5``, stopped."""
SYSTEM: Message = {"role": "system", "content": "guess the number"}
USER: Message = {"role": "user", "content": "guess"}
REPLY: Message = {"role": "assistant", "content": "5"}
NEXT: Message = {"role": "user", "content": "higher"}
LOWER: Message = {"role": "user", "content": "lower"}
TOOLS = [{"type": "function", "function": {"name": "hint"}}]


class NeverContinues(TinyChatTokenizer):
    """A template that renders a history differently once it grows (as some drop earlier reasoning)."""

    def continue_chat(
        self, turns: Sequence[Turn], messages: Sequence[Mapping[str, Any]], *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int] | None:
        return None


def call(session: Session, messages: list[Message], tools: list[Message] | None = None) -> tuple[TurnPlan, str]:
    """One completed call answering ``5``: its plan and the content the agent got."""
    plan = session.begin(messages, "t", tools)
    out = EngineOutput("r", list(FIVE), [-0.1] * len(FIVE), "v1", ["v1"] * len(FIVE), "stop")
    outcome = ChunkOutcome(0, plan.context_ids, out)
    session.chunk(outcome, "e")
    assert session.chunk_sent() is None
    answer = session.complete(Generation(output_ids=list(FIVE), finish_reason="stop", chunks=[outcome]))
    return plan, answer.content


@pytest.mark.parametrize(
    ("second", "reason"),
    [
        ([SYSTEM, USER, REPLY, NEXT], None),  # the answer sent back verbatim: extends token-exact
        ([SYSTEM, USER, REPLY, NEXT, REPLY, NEXT], None),  # several messages at once extend too
        ([SYSTEM, {"role": "user", "content": "number"}, REPLY, NEXT], "history_diverged"),  # an earlier message edited
        ([USER, REPLY, NEXT], "history_diverged"),  # an earlier message dropped
        ([SYSTEM], "history_diverged"),  # truncated
        ([SYSTEM, USER, NEXT], "assistant_dropped"),  # an agent that strips its replies
        ([SYSTEM, USER], "assistant_dropped"),  # the same call again
        ([SYSTEM, USER, {"role": "assistant", "content": "6"}, NEXT], "assistant_edited"),
        ([SYSTEM, USER, {"role": "assistant", "content": ""}, NEXT], "assistant_edited"),
    ],
)
def test_a_second_call_continues_or_says_why_not(second: list[Message], reason: str | None) -> None:
    session = Session("s", "g", tokenizer=TinyChatTokenizer())
    first, content = call(session, [SYSTEM, USER])
    assert (first.new_segment, first.reason) == (True, "first")
    assert content == REPLY["content"]
    plan, _ = call(session, second)
    assert plan.reason == reason
    assert plan.new_segment == (reason is not None)
    assert plan.segment_index == (0 if reason is None else 1)


def test_reasons_follow_the_last_call_of_the_segment() -> None:
    session = Session("s", "g", tokenizer=TinyChatTokenizer())
    call(session, [USER])
    assert call(session, [USER, REPLY, NEXT])[0].reason is None
    plan, _ = call(session, [USER, REPLY, NEXT, LOWER])  # the newest answer must come back, not only an older one
    assert (plan.reason, plan.segment_index) == ("assistant_dropped", 1)
    plan, _ = call(session, [USER, REPLY, NEXT, LOWER, REPLY, NEXT])  # against the new segment's one call
    assert (plan.reason, plan.segment_index) == (None, 1)


def test_a_history_kept_verbatim_that_the_template_will_not_extend() -> None:
    session = Session("s", "g", tokenizer=NeverContinues())
    call(session, [USER])
    assert call(session, [USER, REPLY, NEXT])[0].reason == "template_mismatch"
    assert call(session, [USER, REPLY, NEXT, REPLY, NEXT], TOOLS)[0].reason == "tools_changed"
    assert call(session, [USER, REPLY, NEXT, REPLY, NEXT, REPLY, NEXT], TOOLS)[0].reason == "template_mismatch"


def test_a_segment_closed_by_a_refused_publish() -> None:
    session = Session("s", "g", tokenizer=TinyChatTokenizer())
    call(session, [USER])
    plan = session.begin([USER, REPLY, NEXT], "t")
    out = EngineOutput("r", list(FIVE), [-0.1] * len(FIVE), "v1", ["v1"] * len(FIVE), "stop")
    session.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
    step = session.fail(KafkaUnavailable("no producer"))  # the submit was refused: nothing of this call published
    assert step.ended is None and session.phase == "open"
    plan, _ = call(session, [USER, REPLY, NEXT])
    assert (plan.reason, plan.segment_index) == ("publish_failed", 1)


def test_the_classification_alone() -> None:
    keys = Call.of([USER])
    assert new_segment_reason(None, keys) == "first"
    seg = SegmentState(index=0, turns=[([1], [2])], last_call=keys)
    assert new_segment_reason(seg, Call.of([USER, REPLY])) == "assistant_edited"  # no answer yet
    seg.open = False
    assert new_segment_reason(seg, Call.of([USER, REPLY])) == "publish_failed"


class InstantEngine:
    """Answers every generate at once with ``5`` and a stop (what the service asks of an engine here)."""

    url = "fake://engine"
    version = "v1"

    async def window(self) -> int:
        return 64

    async def generate(
        self, rid: str, input_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids: Sequence[int]
    ) -> EngineOutput:
        return EngineOutput(rid, list(FIVE), [-0.1] * len(FIVE), self.version, [self.version] * len(FIVE), "stop")


def test_the_service_counts_each_new_segment_by_reason() -> None:
    """An agent that strips its replies: every call after the first re-tokenizes, and the counter says why."""
    settings = ProxySettings(admin_token="x" * 16, open_sessions=True, session_key_secret="k" * 16, run_id="r")
    metrics = ProxyMetrics(CollectorRegistry())
    svc = ProxyService(settings, EnginePool([InstantEngine()]), None, PauseController(), metrics,  # type: ignore[list-item, arg-type]
                       TinyChatTokenizer())

    def count(reason: str) -> float:
        return metrics.registry.get_sample_value("rein_proxy_new_segments_total", {"reason": reason}) or 0.0

    async def chat(session_id: str, messages: list[Message]) -> str:
        answer = await svc.chat(CallIds(session_id), messages, budget=4, sampling=Sampling(temperature=1.0),
                                soft_reject=False)
        return answer.content

    async def agent() -> None:
        history: list[Message] = [USER]
        for user in (NEXT, LOWER, NEXT):
            assert await chat("s", history) == "5"
            history = [*history, user]  # the reply is not sent back
        kept: list[Message] = [USER]
        for _ in range(3):  # the positive control: replies sent back extend the one segment
            kept = [*kept, {"role": "assistant", "content": await chat("t", kept)}, NEXT]

    asyncio.run(asyncio.wait_for(agent(), 10))
    assert (count("first"), count("assistant_dropped"), count("assistant_edited")) == (2.0, 2.0, 0.0)
