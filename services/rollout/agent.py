"""One episode through the proxy's OpenAI chat route, then its reward.

The agent is deliberately an ordinary OpenAI-API user: each turn it sends the whole
conversation (the proxy does token-in-token-out on the extended history), appends the
assistant reply and the environment's answer, and at the end reports the reward with
``POST /v1/sessions/{id}/finish``. It speaks the wire through :mod:`services.rollout.proxy_http`, not the
official client (which that module says why); the official clients are tested against the proxy on
their own. Outcomes:

- ``completed`` / ``truncated``: the episode ended and the finish call was delivered
  (``truncated`` when the proxy refused a turn as ``context_overflow``; the reward is
  the task's reward for the turns played).
- ``rejected``: the proxy rejected the session (502 staleness errors, or 409 because it
  already did). The proxy publishes ``SessionRejected`` itself, so no finish is sent.
- ``failed``: any other error (503 engine or Kafka unavailable, timeouts, an unreachable
  proxy). The agent reports ``status: failed`` when it can, so the collector completes
  the group as failed and asks for a retry.

:attr:`EpisodeResult.on_record` says whether the proxy confirmed that the session's end
record is on Kafka. When it did not (the proxy crashed, lost the session, or could not
publish), the rollout runner publishes the end itself, so the group never waits forever.

Every call is bounded by the client's timeout; nothing here retries forever.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

from services.rollout.env_time import EnvTime
from services.rollout.proxy_http import Answer, ProxyHttp, Timeout, Unreachable
from services.rollout.task import Episode, Message
from shared import log
from shared.errors import TIMEOUT, UNREACHABLE
from shared.lender import Lender

STALENESS_ERRORS = frozenset(
    {"partial_rollout_staleness_exceeded", "trajectory_version_changed", "generation_preempted"}
)
"""502 ``detail.error`` values that mean "the proxy rejected this session"."""

Outcome = Literal["completed", "truncated", "failed", "rejected"]


@dataclass(frozen=True)
class SessionIds:
    """Identity of one session, sent as headers on every call."""

    session_id: str
    group_id: str
    prompt_id: str
    attempt: int
    slot: int = 0
    """The episode's place in its group (0..group size - 1)."""

    def headers(self, turn: int) -> dict[str, str]:
        return {
            "X-Session-Id": self.session_id,
            "X-Group-Id": self.group_id,
            "X-Turn-Id": str(turn),
            "X-Prompt-Id": self.prompt_id,
            "X-Attempt": str(self.attempt),
        }


@dataclass
class EpisodeResult:
    session_id: str
    outcome: Outcome
    reward: float = 0.0
    turns: int = 0
    error: str = ""
    """Error name (``detail.error`` of the proxy, or ``timeout`` / ``unreachable`` / ``http_<status>``)."""
    reported: bool = False
    """The finish call was delivered (always False for rejected sessions)."""
    on_record: bool = False
    """The proxy confirmed the session's end record (finish answered, or a 502 rejection it published)."""
    unreachable: bool = False
    """The proxy could not be reached at all (connection refused / reset)."""
    messages: list[Message] = field(default_factory=list)


@dataclass(frozen=True)
class CallError:
    """How the agent reads one failed chat call."""

    outcome: Outcome
    error: str
    unreachable: bool = False
    on_record: bool = False
    """The proxy published the session's end before answering (its 502 staleness rejections)."""


def error_name(body: object) -> str:
    """The machine-readable error of a proxy error body, or ''.

    Accepts rein's ``{"detail": {"error": ...}}`` and the OpenAI ``{"error": {"code"|"type": ...}}`` shape.
    """
    if not isinstance(body, dict):
        return ""
    detail = body.get("detail")
    if isinstance(detail, dict) and isinstance(detail.get("error"), str):
        return str(detail["error"])
    if isinstance(detail, str):
        return detail
    err = body.get("error", body)
    if isinstance(err, str):
        return err
    if isinstance(err, dict):
        for key in ("error", "code", "type"):
            if isinstance(err.get(key), str):
                return str(err[key])
    return ""


def classify(failure: Answer | Timeout | Unreachable) -> CallError:
    """Map a failed chat call to an outcome (the one place that knows the proxy's error contract)."""
    if isinstance(failure, Timeout):
        return CallError("failed", TIMEOUT)
    if isinstance(failure, Unreachable):
        return CallError("failed", UNREACHABLE, unreachable=True)
    name = error_name(failure.body)
    if failure.status == 409 and name != "session_busy":
        # session_finalized: the proxy rejected (or closed) the session; it takes no more calls.
        return CallError("rejected", name or "session_finalized")
    if failure.status == 502 and name in STALENESS_ERRORS:
        return CallError("rejected", name, on_record=True)
    if failure.status in (400, 413) and name == "context_overflow":  # 413: older proxies answered it so
        return CallError("truncated", name)
    return CallError("failed", name or f"http_{failure.status}")


class Agent:
    """Plays episodes through one proxy; each episode borrows its own :class:`ProxyHttp` from a
    :class:`~shared.lender.Lender` (one connection each; the lender says why)."""

    def __init__(
        self,
        clients: Lender[ProxyHttp],
        *,
        proxy_url: str,
        model: str,
        max_tokens: int,
        temperature: float,
        finish_attempts: int = 3,
        env_time: EnvTime | None = None,
    ) -> None:
        self._clients = clients
        self._env_time = env_time or EnvTime()
        self._proxy_url = proxy_url.rstrip("/")
        self._model = model
        self._max_tokens = max_tokens
        self._temperature = temperature
        self._finish_attempts = finish_attempts

    async def run(self, episode: Episode, payload: dict[str, Any], ids: SessionIds) -> EpisodeResult:
        """Play one episode to its end; never raises for proxy or network errors."""
        with self._clients.use() as clients:
            return await self._play(clients, episode, payload, ids)

    async def _play(
        self, http: ProxyHttp, episode: Episode, payload: dict[str, Any], ids: SessionIds
    ) -> EpisodeResult:
        logger = log.get(__name__).bind(session_id=ids.session_id, group_id=ids.group_id, prompt_id=ids.prompt_id)
        messages: list[Message] = episode.reset(payload)
        turn = 0
        request: dict[str, Any] = {"model": self._model, "messages": messages, "max_tokens": self._max_tokens,
                                   "temperature": self._temperature}
        if episode.tools:
            request["tools"] = episode.tools
        while True:
            failure: Answer | Timeout | Unreachable | None = None
            try:
                response = await http.post("/v1/chat/completions", request, headers=ids.headers(turn))
            except (Timeout, Unreachable) as exc:
                failure = exc
            else:
                if response.status != 200 or not isinstance(response.body, dict):
                    failure = response
            if failure is not None:
                call = classify(failure)
                result = EpisodeResult(ids.session_id, call.outcome, turns=turn, error=call.error,
                                       unreachable=call.unreachable, on_record=call.on_record, messages=messages)
                logger.info("episode_call_failed", turn=turn, outcome=call.outcome, error=call.error)
                if call.outcome == "rejected":
                    return result
                if call.outcome == "truncated":
                    result.reward = episode.reward()
                return await self._report(http, result, logger)
            turn += 1
            message = _message(response.body)
            text = str(message.get("content") or "")
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if message.get("tool_calls"):  # sent back as answered: the turn continues token-exact
                answer["tool_calls"] = message["tool_calls"]
            messages.append(answer)
            feedback = episode.step(text, answer.get("tool_calls", ()))
            wait = self._env_time.draw(ids.prompt_id, ids.attempt, ids.slot, turn)
            if wait:  # the environment's answer (or its grade) takes this long
                await asyncio.sleep(wait)
            if feedback is None:
                break
            messages.extend(feedback)
        result = EpisodeResult(ids.session_id, episode.status, reward=episode.reward(), turns=turn, messages=messages)
        return await self._report(http, result, logger)

    async def _report(self, http: ProxyHttp, result: EpisodeResult, logger: Any,
                      finish_as: str | None = None) -> EpisodeResult:
        """Finish the session (named ``finish_as``, its key, when given) and read what the proxy said."""
        status = "failed" if result.outcome == "failed" else result.outcome
        error = (result.error or "")[:200] if status == "failed" else ""
        delivered = await self.finish(http, finish_as or result.session_id, result.reward, status, error)
        if delivered in ("ok", "conflict_retry"):
            result.reported = result.on_record = True
        elif delivered.startswith("conflict_"):
            # The proxy had closed the session (it rejected it, e.g. a soft reject), or refuses to end it (its
            # replica died in a call: ``session_interrupted``): rejected, and the runner puts its end on record.
            why = "session_closed" if delivered == "conflict_first" else delivered.removeprefix("conflict_")
            result.outcome, result.error = "rejected", result.error or why
        else:
            logger.warning("finish_not_delivered", reason=delivered, status=status)
            result.error = result.error or f"finish_{delivered}"
        return result

    async def finish(
        self, http: ProxyHttp, session_id: str, reward: float, status: str, error: str = ""
    ) -> str:
        """POST the finish call; bounded retries while the proxy cannot take it yet.

        Retried: transport errors, 503 (the proxy could not write to Kafka; the session
        stays open) and 409 ``session_busy`` (a timed-out call is still running there).
        Returns ``ok``; ``conflict_first`` (409 ``session_finalized`` on the first try:
        the session had been closed, i.e. rejected); ``conflict_retry`` (the same after
        a try whose answer was lost: our earlier call went through); ``conflict_<error>``
        for any other 409 (``session_interrupted``: a replica took the finish over from one
        that died in a call, perhaps this finish's earlier try, so nothing says the end is on
        Kafka); ``not_found``; ``http_<status>``; or ``unreachable`` / ``busy`` /
        ``unavailable`` when the tries ran out.
        """
        path = f"/v1/sessions/{session_id}/finish"
        delay, last, sent = 0.2, "unreachable", False
        for attempt in range(self._finish_attempts):
            if attempt:
                await asyncio.sleep(delay)
                delay *= 2
            try:
                body: dict[str, Any] = {"reward": reward, "status": status}
                if error:
                    body["error"] = error
                response = await http.post(path, body)
            except (Timeout, Unreachable):
                last, sent = "unreachable", True
                continue
            name = error_name(response.body)
            if response.status == 200:
                return "ok"
            if response.status == 409 and name == "session_busy":
                last = "busy"
                continue
            if response.status == 409 and name in ("", "session_finalized"):
                return "conflict_retry" if sent else "conflict_first"
            if response.status == 409:
                return f"conflict_{name}"
            if response.status == 503:
                last = "unavailable"
                continue
            if response.status == 404:
                return "not_found"
            return f"http_{response.status}"
        return last


def _message(body: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a ``chat.completion`` body ({} when it has none)."""
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict):
            return message
    return {}
