"""shared.errors: statuses, codes, the ``detail`` body each error answers with, and engine body parsing."""

from __future__ import annotations

import json

import pytest

from services.proxy.engine_client import parse_generate
from services.proxy.middleware import error_response
from shared.errors import (
    ContextOverflow,
    EngineError,
    EngineUnavailable,
    GenerationPreempted,
    PartialRolloutStalenessExceeded,
    ReinError,
    RolloutRejected,
    SessionFinalized,
    SessionNotFound,
    TrajectoryVersionChanged,
    Unauthorized,
    UnknownSessionKey,
    UnsupportedParameter,
    http_body,
)
from shared.span_cap import check_span


@pytest.mark.parametrize(
    ("cls", "status", "code"),
    [
        (PartialRolloutStalenessExceeded, 502, "partial_rollout_staleness_exceeded"),
        (TrajectoryVersionChanged, 502, "trajectory_version_changed"),
        (GenerationPreempted, 502, "generation_preempted"),
        (EngineUnavailable, 503, "engine_unavailable"),
        (ContextOverflow, 400, "context_overflow"),
        (SessionNotFound, 404, "session_not_found"),
        (SessionFinalized, 409, "session_finalized"),
        (Unauthorized, 401, "unauthorized"),
    ],
)
def test_status_and_code(cls: type[ReinError], status: int, code: str) -> None:
    err = cls("m", session_id="s")
    assert (err.status, err.code) == (status, code)
    assert http_body(err) == {"detail": {"error": code, "message": "m", "session_id": "s"}}


def test_staleness_errors_share_a_base() -> None:
    for cls in (PartialRolloutStalenessExceeded, TrajectoryVersionChanged, GenerationPreempted):
        assert issubclass(cls, RolloutRejected)


def test_span_rejection_round_trips_to_the_design_body() -> None:
    rejection = check_span(["v1", "v2"], ["v3"], 1, "sess")
    assert rejection is not None
    err = PartialRolloutStalenessExceeded.from_detail(rejection.detail())
    assert err.detail() == rejection.detail()
    assert http_body(err)["detail"]["versions"] == ["v1", "v2", "v3"]
    with pytest.raises(ValueError, match="not a"):
        TrajectoryVersionChanged.from_detail(rejection.detail())


def test_parse_generate_normalises() -> None:
    body = {
        "text": "x",
        "output_ids": [5, 6],
        "meta_info": {"finish_reason": {"type": "Aborted"}, "weight_version": " v2 ",
                      "output_token_logprobs": [[-0.1, 5, "a"], [-0.2, 6, "b"]]},
    }
    out = parse_generate("r", body, "e")
    assert out.finish_reason == "abort" and out.version == "v2" and out.token_versions == ["v2", "v2"]
    assert out.logprobs == [-0.1, -0.2]
    body["meta_info"]["weight_version"] = "unknown"  # type: ignore[index]
    assert parse_generate("r", body, "e").version is None


@pytest.mark.parametrize(
    "body",
    [{}, {"meta_info": {"finish_reason": {"type": "weird"}}}, {"output_ids": [1], "meta_info": {}}],
)
def test_parse_generate_rejects_malformed(body: dict[str, object]) -> None:
    with pytest.raises(EngineError):
        parse_generate("r", body, "e")


# --------------------------------------------------------------------------- each wire's own error shape


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/sessions/rein-sk-x/v1/chat/completions"])
def test_openai_routes_answer_openais_error_shape_with_reins_detail_beside_it(path: str) -> None:
    error = ContextOverflow("prompt of 90 tokens leaves no room", context_window=64, input_tokens=90)
    response = error_response(path, error)
    body = json.loads(response.body)  # type: ignore[arg-type]
    assert response.status_code == 400, "OpenAI's status for a context overflow (413 before)"
    assert body["error"] == {"message": "prompt of 90 tokens leaves no room", "type": "invalid_request_error",
                             "param": None, "code": "context_length_exceeded", "detail": error.detail()}
    assert body["detail"] == error.detail(), "rein's detail, as its runner and tests read it"


def test_an_openai_error_names_the_parameter() -> None:
    error = UnsupportedParameter("unsupported parameter(s): seed", fields=[{"field": "seed", "message": "m"}])
    body = json.loads(error_response("/v1/chat/completions", error).body)  # type: ignore[arg-type]
    assert (body["error"]["param"], body["error"]["code"]) == ("seed", "unsupported_parameter")


@pytest.mark.parametrize(("error", "status", "kind"), [
    (ContextOverflow("prompt too long"), 400, "invalid_request_error"),
    (UnknownSessionKey("not minted here"), 401, "authentication_error"),
    (GenerationPreempted("aborted"), 502, "api_error"),
    (EngineUnavailable("down"), 503, "overloaded_error"),
])
def test_the_messages_route_answers_anthropics_error_shape(error: ReinError, status: int, kind: str) -> None:
    response = error_response("/sessions/rein-sk-x/v1/messages", error)
    body = json.loads(response.body)  # type: ignore[arg-type]
    assert response.status_code == status
    assert body == {"type": "error", "error": {"type": kind, "message": error.message, "detail": error.detail()},
                    "detail": error.detail()}


def test_reins_own_routes_keep_reins_body() -> None:
    body = json.loads(error_response("/v1/sessions/s-1/finish", SessionNotFound("gone", session_id="s-1")).body)  # type: ignore[arg-type]
    assert body == {"detail": {"error": "session_not_found", "message": "gone", "session_id": "s-1"}}
