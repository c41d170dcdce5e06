"""A wire is one module plus one registration line: a wire registered in ``WIRES`` is routed by the proxy
(by API key and by a session key in the path), answers its errors in its own shape, and ``make demo``
counts its answers; the docs name every registered wire."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from ops.demo_metrics import chat_replies
from services.proxy.app import create_app
from services.proxy.auth import CallIds
from services.proxy.metrics import ProxyMetrics
from services.proxy.middleware import RouteLabels
from services.proxy.openai_api import ChatRequest
from services.proxy.replies import ChatOutcome
from services.proxy.settings import ProxySettings
from services.proxy.wire import Call, Wire, parse, validate
from services.proxy.wires import WIRES
from shared import metrics

REPO = Path(__file__).resolve().parents[3]
RUNNER = {"Authorization": "Bearer test-runner-token-4567"}


class SayRequest(BaseModel):
    say: str


def _call(raw: bytes) -> Call:
    request = parse(SayRequest, raw)
    chat = validate(ChatRequest, {"messages": [{"role": "user", "content": request.say}]})
    return Call(chat, lambda body: {"said": body["choices"][0]["message"]["content"]},
                lambda body: iter(()), lambda detail, status: "")


SAY = Wire("/v1/say", _call, lambda detail, status: {"say_error": detail["error"], "status": status})


class AnswersHi:
    """Stands in for the lifespan's service: every chat call is answered "hi" (the session is not this test's)."""

    def __init__(self) -> None:
        self.sessions: list[str] = []

    async def chat(self, ids: CallIds, messages: list[dict[str, Any]], **_: Any) -> ChatOutcome:
        self.sessions.append(ids.session_id)
        return ChatOutcome(content="hi", finish_reason="stop", prompt_tokens=1, completion_tokens=1, rein={})


@pytest.fixture
def say(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wire]:
    """``SAY`` registered for one test, gone after it."""
    monkeypatch.setitem(WIRES, SAY.route, SAY)
    yield SAY
    monkeypatch.undo()
    assert SAY.route not in WIRES


def _app() -> FastAPI:
    return create_app(ProxySettings(admin_token="test-admin-token-0123", runner_token=RUNNER["Authorization"][7:],
                                    session_key_secret="test-session-key-secret-89ab", run_id="test-run"))


def test_a_registered_wire_is_served_and_counted(say: Wire) -> None:
    client = TestClient(_app())  # no lifespan: its service and metrics are stand-ins
    service, proxy_metrics = AnswersHi(), ProxyMetrics(CollectorRegistry())
    client.app_state.update(service=service, metrics=proxy_metrics)
    opened = client.post("/v1/sessions", json={"group_id": "g-1"}, headers=RUNNER).json()

    by_path = client.post(f"/sessions/{opened['api_key']}{say.route}", json={"say": "hello"})
    by_key = client.post(say.route, json={"say": "hello"}, headers={"Authorization": f"Bearer {opened['api_key']}"})
    assert [by_path.json(), by_key.json()] == [{"said": "hi"}, {"said": "hi"}]
    assert service.sessions == [opened["session_id"]] * 2

    refused = client.post(say.route, content=b"{", headers={"Authorization": f"Bearer {opened['api_key']}"})
    assert (refused.status_code, refused.json()) == (422, {"say_error": "invalid_request", "status": 422})

    text = metrics.render(proxy_metrics.registry)[0].decode()
    assert 'route="/v1/say",status="200"' in text and 'route="/v1/sessions",status="200"' in text
    assert chat_replies(text) == 2, "make demo counts the wire's answers, and only the wires'"


@pytest.mark.parametrize(("path", "label"), [
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/sessions/rein-sk-secret/v1/messages", "/v1/messages"),
    ("/sessions/rein-sk-secret/v1/models", "/v1/models"),
    ("/v1/sessions", "/v1/sessions"),
    ("/v1/sessions/rein-sk-secret/finish", "/v1/sessions/{id}/finish"),
    ("/v1/rollout/renew", "/v1/rollout/renew"),
    ("/metrics", "/metrics"),
    ("/docs", "other"),
    ("/v1/nothing", "other"),
])
def test_requests_are_labelled_by_their_route_never_by_a_key(path: str, label: str) -> None:
    assert RouteLabels(_app().routes)(path) == label


def test_the_docs_name_every_wire() -> None:
    """The agents' guide opens with the wires the proxy serves, and the security table with what an agent may call."""
    agents = (REPO / "docs/agents.md").read_text().split("\n## ")[0]
    security = (REPO / "docs/security.md").read_text()
    for route in WIRES:
        assert re.search(rf"`POST {re.escape(route)}`", agents), f"docs/agents.md's opening does not name {route}"
        assert f"`{route}`" in security, f"docs/security.md does not list {route} among an agent's calls"
