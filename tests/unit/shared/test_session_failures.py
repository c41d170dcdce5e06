"""Session error codes, declared once: what the window charges and when the runner's gate closes."""

from __future__ import annotations

import pytest

from shared import errors
from shared.errors import BACKEND_DOWN_ERRORS, SESSION_FAILURES, UNCHARGED_ERRORS, ReinError


def _codes(cls: type[ReinError]) -> set[str]:
    out = {cls.code}
    for sub in cls.__subclasses__():
        out |= _codes(sub)
    return out


def test_the_two_sets_are_read_from_one_table() -> None:
    assert {"unreachable", "engine_unavailable", "kafka_unavailable", "timeout"} == BACKEND_DOWN_ERRORS
    assert BACKEND_DOWN_ERRORS | {"engine_lost", "session_idle", "incomplete", "session_lost", "redis_unavailable",
                                  "session_interrupted", "session_moved"} == UNCHARGED_ERRORS


def test_a_down_backend_is_never_the_prompts_fault() -> None:
    assert BACKEND_DOWN_ERRORS <= UNCHARGED_ERRORS


def test_the_prompts_and_the_policys_own_failures_are_charged_and_leave_the_gate_open() -> None:
    own = {"partial_rollout_staleness_exceeded", "trajectory_version_changed", "generation_preempted",
           "context_overflow", "session_busy", "engine_error", "bad_request"}
    assert not own & (UNCHARGED_ERRORS | BACKEND_DOWN_ERRORS)


def test_every_code_in_the_table_is_a_proxy_error_or_named_here() -> None:
    named = {errors.UNREACHABLE, errors.TIMEOUT, errors.INCOMPLETE, errors.SESSION_LOST}
    assert set(SESSION_FAILURES) <= _codes(ReinError) | named


def test_an_error_declares_its_status_and_a_code_of_its_own() -> None:
    assert (errors.MissingHeader.status, errors.MissingHeader.code) == (400, "missing_header")
    assert (errors.EngineLost.status, errors.InvalidRequest.status) == (503, 422)
    with pytest.raises(TypeError, match="code"):
        type("NoCode", (errors.BadRequest,), {}, status=400)
    with pytest.raises(TypeError, match="BadRequest's already"):
        type("Twin", (errors.BadRequest,), {}, status=400, code="bad_request")
    assert errors.BadRequest.code == "bad_request"  # the refused twin left the original alone
