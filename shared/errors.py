"""rein's error hierarchy: one root, each class carrying its HTTP status and detail.

Services raise these deep in their logic and map them to HTTP in exactly one
exception handler (``err.status``, and ``{"detail": err.detail()}`` in the body, beside the wire's own
error shape on the proxy's agent routes); nothing
below a route builds an ``HTTPException``. ``code`` is the stable machine name
agents and the rollout runner match on (``partial_rollout_staleness_exceeded``,
``trajectory_version_changed``, ``generation_preempted``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

E = TypeVar("E", bound="ReinError")

_CODES: dict[str, type[ReinError]] = {}
"""Every error's code, to its class: a code names one error."""


class ReinError(Exception):
    """Root of every error rein maps to an HTTP status; unexpected bugs stay plain exceptions."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"

    def __init_subclass__(cls, *, status: int, code: str, **kwargs: Any) -> None:
        """Each error declares its HTTP ``status`` and its ``code`` where it is named; a subclass without them,
        or with a code another error has, is a TypeError at import."""
        super().__init_subclass__(**kwargs)
        if code in _CODES:
            raise TypeError(f"{cls.__name__}: code {code!r} is {_CODES[code].__name__}'s already")
        _CODES[code] = cls
        cls.status, cls.code = status, code

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields: dict[str, Any] = dict(fields)

    def detail(self) -> dict[str, Any]:
        """The structured body under ``detail``: ``{"error": code, "message": ..., **fields}``."""
        return {"error": self.code, "message": self.message, **self.fields}

    @classmethod
    def from_detail(cls: type[E], detail: Mapping[str, Any]) -> E:
        """Rebuild from a detail mapping (``SpanRejection.detail()``); ``error`` must match ``code``."""
        fields = dict(detail)
        error = fields.pop("error", cls.code)
        if error != cls.code:
            raise ValueError(f"detail is a {error!r}, not a {cls.code!r}")
        message = str(fields.pop("message", cls.code))
        return cls(message, **fields)


# --------------------------------------------------------------------------- 4xx: the caller's fault


class BadRequest(ReinError, status=400, code="bad_request"):
    """The request is missing something the endpoint needs (a header, a consistent id)."""


class UnsupportedContent(BadRequest, status=400, code="unsupported_content"):
    """A message holds what the served model cannot take (an image or audio part for a text model)."""


class UnsupportedParameter(BadRequest, status=400, code="unsupported_parameter"):
    """A request parameter this proxy cannot honour (``fields`` names each); refused, never ignored."""


class MissingHeader(BadRequest, status=400, code="missing_header"):
    """A required header (``X-Session-Id``) is absent or empty."""


class InvalidRequest(ReinError, status=422, code="invalid_request"):
    """The body does not match the schema; ``fields`` names each offending field."""


class Unauthorized(ReinError, status=401, code="unauthorized"):
    """A call without the credential its route needs, or with a wrong one."""


class Forbidden(ReinError, status=403, code="forbidden"):
    """A valid credential of a role the route is not for (an agent's session key where the runner's is needed)."""


class UnknownSessionKey(Unauthorized, status=401, code="unknown_session_key"):
    """A chat call's API key (or the key in its path) is not a valid session key of this run."""


class SessionNotFound(ReinError, status=404, code="session_not_found"):
    """No session with this id is known to this proxy."""


class SessionConflict(ReinError, status=409, code="session_conflict"):
    """The session exists but cannot take this call in its current state."""


class SessionFinalized(SessionConflict, status=409, code="session_finalized"):
    """The session was finished or rejected; it takes no more calls."""


class SessionBusy(SessionConflict, status=409, code="session_busy"):
    """Another call of the same session is still running (a session is one conversation)."""


class SessionIdle(SessionConflict, status=409, code="session_idle"):
    """The proxy rejected the session after it had no call for its idle timeout (the agent is gone)."""


class SessionInterrupted(SessionConflict, status=409, code="session_interrupted"):
    """The proxy that held the session died (or lost it) during a call: that call's chunks may be partly on
    Kafka, so no other replica continues the session (its chunks would number from the wrong place)."""


class SessionMoved(SessionConflict, status=409, code="session_moved"):
    """Another proxy replica took the session over (the balancer sent it a call while this one was out of
    its rotation): this replica's copy is stale and takes no more calls."""


class StalePause(ReinError, status=409, code="stale_pause"):
    """A renew or resume named a pause that is not the proxy's current one (its lease ran out, or a
    newer pause took over): refused, so a late control call cannot end someone else's pause."""


class PayloadTooLarge(ReinError, status=413, code="request_too_large"):
    """The request body exceeds the configured size limit."""


class ContextOverflow(BadRequest, status=400, code="context_overflow"):
    """The prompt leaves no room for one generated token in the context window (400, as OpenAI's
    ``context_length_exceeded`` and Anthropic's prompt too long: what agents catch to compact their history)."""


# --------------------------------------------------------------------------- 502: the staleness rejections


class RolloutRejected(ReinError, status=502, code="rollout_rejected"):
    """A staleness rule rejected the session (soft reject may turn it into an empty 200)."""


class PartialRolloutStalenessExceeded(RolloutRejected, status=502, code="partial_rollout_staleness_exceeded"):
    """The session would span more than ``max_preempts + 1`` distinct real weight versions."""


class TrajectoryVersionChanged(RolloutRejected, status=502, code="trajectory_version_changed"):
    """Partial rollout is off and the weight version changed inside the session."""


class GenerationPreempted(RolloutRejected, status=502, code="generation_preempted"):
    """Partial rollout is off and the generation was aborted mid-way (a weight update)."""


class EngineError(ReinError, status=502, code="engine_error"):
    """The inference engine answered, but with an error or a malformed body."""


# --------------------------------------------------------------------------- 503: a dependency is down


class DependencyUnavailable(ReinError, status=503, code="unavailable"):
    """A dependency did not answer within its bound; the call may be retried later."""


class EngineUnavailable(DependencyUnavailable, status=503, code="engine_unavailable"):
    """The inference engine could not be reached (connect / read timeout, refused)."""


class EngineLost(EngineUnavailable, status=503, code="engine_lost"):
    """The engine a session sticks to failed its health checks or left: the session, which holds tokens of
    that engine, is rejected on record (its prefix and version live there; it is not moved)."""


class KafkaUnavailable(DependencyUnavailable, status=503, code="kafka_unavailable"):
    """A record could not be written to Kafka; the call fails rather than lose training data."""


class StateStoreUnavailable(DependencyUnavailable, status=503, code="redis_unavailable"):
    """Redis did not answer where the call needs it (reading a session another replica held)."""


def http_body(error: ReinError) -> dict[str, Any]:
    """The JSON body of ``error``'s HTTP response: ``{"detail": {...}}``."""
    return {"detail": error.detail()}


# --------------------------------------------------------------------------- why a session ended abnormally

UNREACHABLE = "unreachable"
"""The runner could not reach the proxy (connection refused or reset)."""
TIMEOUT = "timeout"
"""A call of the runner to the proxy got no answer within its bound."""
INCOMPLETE = "incomplete"
"""The collector gave up waiting for a session's records (its group was failed whole)."""
SESSION_LOST = "session_lost"
"""The runner ended a session the proxy could not end on record (the proxy died or lost it)."""


@dataclass(frozen=True)
class SessionFailure:
    """What a session error says, for the two places that act on it."""

    charged: bool
    """A group failed by it uses one of its prompt's ``max_retries`` (the window's retry rule); an uncharged
    failure is a dependency's or the agent process's fault, not the prompt's or the policy's."""
    backend_down: bool
    """The backend as a whole is down (the rollout runner's gate then slows dispatch to one probe group)."""


SESSION_FAILURES: Mapping[str, SessionFailure] = {
    UNREACHABLE: SessionFailure(charged=False, backend_down=True),
    TIMEOUT: SessionFailure(charged=False, backend_down=True),
    EngineUnavailable.code: SessionFailure(charged=False, backend_down=True),
    KafkaUnavailable.code: SessionFailure(charged=False, backend_down=True),
    # one engine failed; new sessions go to the healthy ones (with none left, they fail engine_unavailable)
    EngineLost.code: SessionFailure(charged=False, backend_down=False),
    SessionIdle.code: SessionFailure(charged=False, backend_down=False),  # the agent's process is gone
    StateStoreUnavailable.code: SessionFailure(charged=False, backend_down=False),  # one takeover, not the backend
    SessionInterrupted.code: SessionFailure(charged=False, backend_down=False),  # its proxy died mid-call
    SessionMoved.code: SessionFailure(charged=False, backend_down=False),
    INCOMPLETE: SessionFailure(charged=False, backend_down=False),
    SESSION_LOST: SessionFailure(charged=False, backend_down=False),
}
"""Every session error the window or the runner treats apart; any other (a staleness rejection, a context
overflow, an agent's own error) is charged and does not say the backend is down."""

UNCHARGED_ERRORS = frozenset(code for code, f in SESSION_FAILURES.items() if not f.charged)
"""Session errors that say a dependency or the agent's process failed, not the prompt or the policy.
A group failed only by these is retried without using up one of the prompt's ``max_retries`` (up to
``max_free_retries`` times)."""
BACKEND_DOWN_ERRORS = frozenset(code for code, f in SESSION_FAILURES.items() if f.backend_down)
"""Session errors that say the backend is down, not that the prompt or the policy failed."""
