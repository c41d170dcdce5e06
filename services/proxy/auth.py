"""Who may do what on the proxy, and which session a call names: pure (headers in, a decision out).

Three roles, each with its own credential (docs/security.md):

- the **operator** holds the admin token (``REIN_ADMIN_TOKEN``): the control plane (pause, renew, resume, state);
- the **runner**, whoever runs the agent, holds the runner token (``REIN_RUNNER_TOKEN``): it opens sessions
  (mints their keys), finishes them (posts rewards) and may drive a session named by ``X-Session-Id``;
- the **agent** holds only its session key: chat calls in its own session, nothing else. An agent runs
  model-written commands, so whatever it holds the policy can learn to use; a reward it could post is a
  reward the policy could learn to post.

``REIN_OPEN_SESSIONS=true`` drops the runner's check (an open local set-up where anyone who reaches the
proxy may open, drive and finish sessions); session keys and the admin token are checked either way.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.proxy.session_keys import BadSessionKey, KeySigner, SessionKey, is_key
from shared.errors import Forbidden, InvalidRequest, MissingHeader, Unauthorized, UnknownSessionKey


@dataclass(frozen=True)
class CallIds:
    """Identity of one chat call: its session, and what the session was opened for."""

    session_id: str
    group_id: str = ""
    turn_id: str = ""
    prompt_id: str = ""
    attempt: int = 0


class Headers:
    """A request's headers by name, read in one pass: Starlette's ``Headers.get`` scans them all per lookup
    and raises inside for an absent one, and the openai client sends a dozen. First occurrence wins, as there;
    names are lowercase in ASGI."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._by_name = dict(reversed(raw))

    def get(self, name: bytes, default: str = "") -> str:
        value = self._by_name.get(name)
        return default if value is None else value.decode("latin-1")

    def bearer(self) -> str:
        """The token of ``Authorization: Bearer``; empty without one."""
        value = self.get(b"authorization").strip()
        return value[7:].strip() if value[:7].lower() == "bearer " else ""

    def api_key(self) -> str:
        """The call's API key: the bearer token as OpenAI's clients send it, else ``x-api-key`` as Anthropic's
        do; empty when neither."""
        return self.bearer() or self.get(b"x-api-key").strip()


@dataclass(frozen=True)
class Auth:
    """The proxy's credentials and its rules for them."""

    admin_token: str
    runner_token: str
    open_sessions: bool
    keys: KeySigner
    clock: Callable[[], float] = field(default=time.time)

    def require_admin(self, headers: Headers) -> None:
        """401 unless the call carries the admin token as its bearer."""
        if not _same(headers.bearer(), self.admin_token):
            raise Unauthorized("the control plane needs 'Authorization: Bearer <REIN_ADMIN_TOKEN>'")

    def require_runner(self, headers: Headers, what: str) -> None:
        """403 for a session key (an agent's), 401 for anything but the runner token; ``what`` names the act."""
        if self.open_sessions:
            return
        given = headers.api_key()
        if is_key(given):
            raise Forbidden(f"{what} needs the runner's credential; a session key authorises chat calls in its "
                            "own session only")
        if not _same(given, self.runner_token):
            raise Unauthorized(f"{what} needs 'Authorization: Bearer <REIN_RUNNER_TOKEN>' (the runner's credential)")

    def mint(self, key: SessionKey) -> str:
        return self.keys.mint(key, self.clock())

    def session_key(self, text: str) -> SessionKey:
        """What a session key stands for; 401 ``unknown_session_key`` saying why it stands for none."""
        try:
            return self.keys.read(text, self.clock())
        except BadSessionKey as exc:
            raise UnknownSessionKey(f"unknown session key: {exc}; open a session with POST /v1/sessions") from None

    def call_ids(self, headers: Headers, path_key: str | None = None) -> CallIds:
        """The chat call's session: the key in its path, else ``X-Session-Id`` (the runner's credential
        required), else its API key as a session key."""
        turn_id = headers.get(b"x-turn-id").strip()
        session_id = headers.get(b"x-session-id").strip()
        key = path_key
        if key is None and not session_id:
            key = headers.api_key()
        if key is not None:
            if not key:
                raise MissingHeader("no session: send an API key or base URL from POST /v1/sessions (or header "
                                    "X-Session-Id with the runner's credential)", header="X-Session-Id")
            ids = self.session_key(key)
            return CallIds(ids.session_id, ids.group_id, turn_id, ids.prompt_id, ids.attempt)
        self.require_runner(headers, "a call that names its session by X-Session-Id")
        attempt_text = headers.get(b"x-attempt", "0").strip() or "0"
        if not (attempt_text.isascii() and attempt_text.isdigit()):  # '²'.isdigit() but int('²') fails
            raise InvalidRequest(f"header X-Attempt must be an integer >= 0, got {attempt_text!r}",
                                 fields=[{"field": "X-Attempt", "message": "not an integer >= 0"}])
        return CallIds(
            session_id=session_id,
            group_id=headers.get(b"x-group-id").strip(),
            turn_id=turn_id,
            prompt_id=headers.get(b"x-prompt-id").strip(),
            attempt=int(attempt_text),
        )


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison; an unset credential matches nothing."""
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())
