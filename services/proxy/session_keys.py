"""Session credentials for agents that set only a base URL and an API key, pure.

A black-box agent (a CLI with its own harness) cannot send ``X-Session-Id``; it takes
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``. Whoever runs it opens the session first
(``POST /v1/sessions``) and gives the agent the key, or a base URL with the key in its path. A key
names what the headers would: session, group, prompt and attempt, signed with the deployment's
admin token (HMAC-SHA256), so any proxy replica reads it without shared state, and a key that was
not minted here, or was altered, is refused with a clear 401 instead of becoming an untracked
session. Format: ``rein-sk-`` + base64url(JSON) + ``.`` + base64url(tag).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass

PREFIX = "rein-sk-"


class BadSessionKey(ValueError):
    """Not a key this deployment minted; the message says what is wrong with it."""


@dataclass(frozen=True)
class SessionKey:
    """What a key stands for: the ids a call's headers would carry."""

    session_id: str
    group_id: str
    prompt_id: str = ""
    attempt: int = 0


def is_key(text: str) -> bool:
    """Whether ``text`` has the shape of a session key (it may still fail :func:`read`)."""
    return text.startswith(PREFIX)


def mint(key: SessionKey, secret: str) -> str:
    """The credential for ``key``."""
    payload = json.dumps(
        {"s": key.session_id, "g": key.group_id, "p": key.prompt_id, "a": key.attempt},
        separators=(",", ":"), ensure_ascii=False,
    ).encode()
    return f"{PREFIX}{_b64(payload)}.{_b64(_tag(payload, secret))}"


def read(text: str, secret: str) -> SessionKey:
    """The session ``text`` stands for; :class:`BadSessionKey` when it is not a key minted with ``secret``."""
    if not is_key(text):
        raise BadSessionKey(f"not a session key (those start with {PREFIX!r})")
    body, dot, tag = text[len(PREFIX):].partition(".")
    try:
        payload, got = _unb64(body), _unb64(tag)
    except ValueError:
        raise BadSessionKey("a session key that is not base64url") from None
    if not dot or not hmac.compare_digest(got, _tag(payload, secret)):
        raise BadSessionKey("a session key this deployment did not mint (or one that was altered)")
    try:
        obj = json.loads(payload)
        out = SessionKey(str(obj["s"]), str(obj["g"]), str(obj["p"]), int(obj["a"]))
    except (ValueError, KeyError, TypeError):
        raise BadSessionKey("a signed session key with an unreadable body") from None
    if not out.session_id or out.attempt < 0:
        raise BadSessionKey("a signed session key without a session id")
    return out


def _tag(payload: bytes, secret: str) -> bytes:
    return hmac.new(secret.encode(), payload, hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if not text.isascii():
        raise ValueError("not ascii")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
