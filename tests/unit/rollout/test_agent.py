"""The agent against a scripted proxy served in this process (uvicorn in a thread, on 127.0.0.1).

Checks the proxy contract the agent relies on: extended history each turn, the
identity headers, finish with the task's reward, and the outcome of each error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ops.local.ports import free_port
from services.rollout.agent import Agent, EpisodeResult, SessionIds, classify, error_name
from services.rollout.env_time import EnvTime
from services.rollout.proxy_http import Answer, ProxyHttp, Timeout, Unreachable
from services.rollout.task import GuessEpisode, binary_search_policy
from shared.lender import Lender
from tests.support.proxy import ServerThread

Replier = Callable[[list[dict[str, str]], int], tuple[int, Any]]
"""(messages, call index) -> (status, body or assistant text)."""


@dataclass
class FakeProxy:
    reply: Replier
    finish_replies: list[tuple[int, Any]] = field(default_factory=lambda: [(200, {})])
    """Answers to successive finish calls; the last one repeats."""
    calls: list[dict[str, Any]] = field(default_factory=list)
    finishes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    """``time.monotonic()`` of every chat and finish call, in order of arrival."""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            self.arrivals.append(time.monotonic())
            body = await request.json()
            self.calls.append({"body": body, "headers": dict(request.headers)})
            status, out = self.reply(body["messages"], len(self.calls) - 1)
            if status != 200:
                return JSONResponse(out, status_code=status)
            return JSONResponse({
                "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": out}}],
            })

        @app.post("/v1/sessions/{session_id}/finish")
        async def finish(session_id: str, request: Request) -> JSONResponse:
            self.arrivals.append(time.monotonic())
            self.finishes.append((session_id, await request.json()))
            status, body = self.finish_replies[min(len(self.finishes), len(self.finish_replies)) - 1]
            return JSONResponse(body, status_code=status)

        return app


IDS = SessionIds("s-1", "g-1", "p-1", 2)
PAYLOAD = {"secret": 11, "low": 0, "high": 15, "max_turns": 5}


def _serve(proxy: FakeProxy) -> ServerThread:
    server = ServerThread(proxy.app(), free_port())
    server.start()
    return server


class _FirstFinishAnswerLost(ProxyHttp):
    """The first finish reaches the proxy, but its answer is lost on the way back (its replica died)."""

    lost = False

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Answer:
        answer = await super().post(path, body, headers)
        if path.endswith("/finish") and not self.lost:
            self.lost = True
            raise Unreachable("the connection closed before the answer")
        return answer


def _run(proxy: FakeProxy, payload: dict[str, Any] = PAYLOAD, env_time: EnvTime | None = None,
         lose_first_finish: bool = False) -> EpisodeResult:
    server = _serve(proxy)

    async def go() -> EpisodeResult:
        http = (_FirstFinishAnswerLost if lose_first_finish else ProxyHttp)(server.url, {"Authorization": "Bearer k"},
                                                                           5.0)
        try:
            agent = Agent(Lender(lambda: http), proxy_url=server.url, model="rein-tiny", max_tokens=3,
                          temperature=1.0, finish_attempts=2, env_time=env_time)
            return await agent.run(GuessEpisode(), dict(payload), IDS)
        finally:
            await http.aclose()

    try:
        return asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        server.stop()


def _binary(messages: list[dict[str, str]], _i: int) -> tuple[int, Any]:
    return 200, binary_search_policy(messages)


def test_full_episode_sends_history_headers_and_reward() -> None:
    proxy = FakeProxy(_binary)
    result = _run(proxy)
    # 0..15, secret 11: guesses 7 (higher), 11 (correct) -> 2 turns
    assert result.outcome == "completed" and result.turns == 2 and result.reported
    assert result.reward == pytest.approx(0.85)
    assert proxy.finishes == [("s-1", {"reward": pytest.approx(0.85), "status": "completed"})]
    first, second = proxy.calls
    assert first["body"]["messages"] == [{"role": "user", "content": "guess the number between 0 and 15"}]
    assert second["body"]["messages"][1:] == [{"role": "assistant", "content": "7"},
                                              {"role": "user", "content": "higher"}]
    assert first["body"]["max_tokens"] == 3 and first["body"]["temperature"] == 1.0
    for turn, call in enumerate(proxy.calls):
        h = call["headers"]
        assert (h["x-session-id"], h["x-group-id"], h["x-prompt-id"], h["x-attempt"], h["x-turn-id"]) == (
            "s-1", "g-1", "p-1", "2", str(turn))


def test_each_environment_step_waits_its_environment_time_the_grade_included() -> None:
    proxy = FakeProxy(_binary)
    env = EnvTime(median_s=0.15, sigma=1.0, seed=3)
    waits = [env.draw(IDS.prompt_id, IDS.attempt, IDS.slot, turn) for turn in (1, 2)]  # "higher", then the grade
    result = _run(proxy, env_time=env)
    assert result.outcome == "completed" and result.turns == 2 and result.reported
    first, second, finish = proxy.arrivals
    assert min(waits) > 0.05
    assert second - first >= waits[0] and finish - second >= waits[1]


def test_turn_limit_reports_zero() -> None:
    proxy = FakeProxy(lambda _m, _i: (200, "0"))
    result = _run(proxy)
    assert (result.outcome, result.turns, result.reward) == ("completed", 5, 0.0)
    assert proxy.finishes == [("s-1", {"reward": 0.0, "status": "completed"})]


@pytest.mark.parametrize(
    ("status", "body", "outcome", "error", "finish_status", "on_record"),
    [
        (502, {"detail": {"error": "partial_rollout_staleness_exceeded", "versions": ["v0", "v1", "v2"]}},
         "rejected", "partial_rollout_staleness_exceeded", None, True),
        (502, {"detail": {"error": "trajectory_version_changed"}}, "rejected", "trajectory_version_changed", None,
         True),
        (502, {"detail": {"error": "generation_preempted"}}, "rejected", "generation_preempted", None, True),
        # closed earlier, maybe without a record (the proxy could not publish): the runner ends it itself
        (409, {"detail": {"error": "session_finalized"}}, "rejected", "session_finalized", None, False),
        (409, {"detail": {"error": "session_busy"}}, "failed", "session_busy", "failed", True),
        (503, {"detail": {"error": "engine_unavailable"}}, "failed", "engine_unavailable", "failed", True),
        (502, {"detail": {"error": "engine_error"}}, "failed", "engine_error", "failed", True),
        (500, {"detail": "boom"}, "failed", "boom", "failed", True),
        # OpenAI's shape with rein's detail beside it (400 context_length_exceeded), and an older proxy (413)
        (400, {"error": {"code": "context_length_exceeded"}, "detail": {"error": "context_overflow"}}, "truncated",
         "context_overflow", "truncated", True),
        (413, {"detail": {"error": "context_overflow"}}, "truncated", "context_overflow", "truncated", True),
    ],
)
def test_error_on_second_turn(status: int, body: dict[str, Any], outcome: str, error: str,
                              finish_status: str | None, on_record: bool) -> None:
    proxy = FakeProxy(lambda m, i: (200, "0") if i == 0 else (status, body))
    result = _run(proxy)
    assert (result.outcome, result.error, result.turns, result.on_record) == (outcome, error, 1, on_record)
    if finish_status is None:
        assert proxy.finishes == [] and not result.reported
    else:
        # a failed session's finish says why, so a dependency's failure does not use up the prompt's retries
        sent = {"reward": 0.0, "status": finish_status, **({"error": error} if finish_status == "failed" else {})}
        assert proxy.finishes == [("s-1", sent)] and result.reported


FINALIZED = (409, {"detail": {"error": "session_finalized"}})
BUSY = (409, {"detail": {"error": "session_busy"}})
KAFKA_DOWN = (503, {"detail": {"error": "kafka_unavailable"}})


@pytest.mark.parametrize(
    ("replies", "outcome", "reported", "calls"),
    [
        ([FINALIZED], "rejected", False, 1),  # closed before our first finish: the proxy had rejected it
        ([BUSY, (200, {})], "completed", True, 2),
        ([KAFKA_DOWN, (200, {})], "completed", True, 2),
        ([KAFKA_DOWN, KAFKA_DOWN], "completed", False, 2),  # tries run out: not delivered, no hang
        ([(404, {"detail": {"error": "session_not_found"}})], "completed", False, 1),
    ],
)
def test_finish_answers(replies: list[tuple[int, Any]], outcome: str, reported: bool, calls: int) -> None:
    proxy = FakeProxy(_binary, finish_replies=replies)
    result = _run(proxy)
    assert (result.outcome, result.reported, len(proxy.finishes)) == (outcome, reported, calls)
    assert result.on_record is reported  # no confirmed end: the runner must publish one itself


INTERRUPTED = (409, {"detail": {"error": "session_interrupted"}})


@pytest.mark.parametrize(
    ("replies", "lose_first", "outcome", "error", "on_record"),
    [
        ([FINALIZED], True, "completed", "", True),  # the try whose answer was lost ended the session
        # Another replica refused the retry: the first try's replica died in the finish, maybe before the
        # end reached Kafka, so the runner must put one on record (else the group waits forever).
        ([INTERRUPTED], True, "rejected", "session_interrupted", False),
        ([INTERRUPTED], False, "rejected", "session_interrupted", False),
    ],
)
def test_a_finish_refused_after_a_lost_answer_is_on_record_only_when_the_session_ended(
        replies: list[tuple[int, Any]], lose_first: bool, outcome: str, error: str, on_record: bool) -> None:
    proxy = FakeProxy(_binary, finish_replies=[(200, {}), *replies] if lose_first else replies)
    result = _run(proxy, lose_first_finish=lose_first)
    assert (result.outcome, result.error, result.on_record) == (outcome, error, on_record)
    assert len(proxy.finishes) == (2 if lose_first else 1)


def test_unreachable_proxy_fails_fast_without_hanging() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused

    async def go() -> EpisodeResult:
        http = ProxyHttp(url, {}, 5.0)
        try:
            agent = Agent(Lender(lambda: http), proxy_url=url, model="m", max_tokens=3, temperature=1.0,
                          finish_attempts=2)
            return await agent.run(GuessEpisode(), dict(PAYLOAD), IDS)
        finally:
            await http.aclose()

    result = asyncio.run(asyncio.wait_for(go(), 30))
    assert (result.outcome, result.error, result.unreachable, result.reported) == ("failed", "unreachable", True,
                                                                                    False)
    assert not result.on_record


@pytest.mark.parametrize(
    ("body", "name"),
    [({"detail": {"error": "x"}}, "x"), ({"error": {"code": "c"}}, "c"), ({"type": "t"}, "t"),
     ({"detail": "plain"}, "plain"), ("text", ""), (None, ""), ({}, "")],
)
def test_error_name(body: object, name: str) -> None:
    assert error_name(body) == name


def test_classify_timeout_and_unreachable() -> None:
    assert classify(Timeout("read")).error == "timeout"
    assert (classify(Unreachable("refused")).error, classify(Unreachable("refused")).unreachable) == (
        "unreachable", True)


def test_concurrent_episodes_borrow_their_own_clients_and_give_them_back() -> None:
    """Each episode in flight has its own client pair (one connection each); later episodes reuse them."""
    proxy = FakeProxy(_binary)
    server = _serve(proxy)
    made: list[ProxyHttp] = []

    def make() -> ProxyHttp:
        made.append(ProxyHttp(server.url, {}, 5.0))
        return made[-1]

    async def go() -> list[EpisodeResult]:
        clients = Lender(make)
        agent = Agent(clients, proxy_url=server.url, model="m", max_tokens=3, temperature=1.0)
        ids = [SessionIds(f"s-{i}", "g-1", "p-1", 0) for i in range(3)]
        results = list(await asyncio.gather(*(agent.run(GuessEpisode(), dict(PAYLOAD), i) for i in ids)))
        assert (len(made), clients.lent) == (3, 0)
        results.append(await agent.run(GuessEpisode(), dict(PAYLOAD), SessionIds("s-3", "g-2", "p-2", 0)))
        assert len(made) == 3  # the fourth, alone, reused one
        for client in made:
            await client.aclose()
        return results

    try:
        results = asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        server.stop()
    assert [r.outcome for r in results] == ["completed"] * 4 and all(r.reported for r in results)
    assert sorted(sid for sid, _ in proxy.finishes) == ["s-0", "s-1", "s-2", "s-3"]
