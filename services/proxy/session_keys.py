"""Session keys: the one credential an agent holds, pure.

A black-box agent (a CLI with its own harness) cannot send ``X-Session-Id``; it takes
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``. Whoever runs it opens the session first
(``POST /v1/sessions``, with the runner's credential) and gives the agent the key, or a base URL with the
key in its path. A key names what the headers would (session, group, prompt, attempt) plus the run it
was minted for and when it expires, signed with the deployment's session-key secret (HMAC-SHA256), so any
proxy replica reads it without shared state. It authorises chat calls in its own session and nothing
else (docs/security.md).

Refused with a clear reason: a key not minted with this secret or altered, one minted for another run,
an expired one, and any spelling but the canonical one (base64 decoders skip stray characters, so a key
with an inserted ``!`` would read as the same session while a balancer hashing the string sends it
elsewhere). Format: ``rein-sk-`` + base64url(JSON) + ``.`` + base64url(tag), unpadded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass

PREFIX = "rein-sk-"


class BadSessionKey(ValueError):
    """Not a key this deployment minted for this run, or no longer valid; the message says why."""


@dataclass(frozen=True)
class SessionKey:
    """What a key stands for: the ids a call's headers would carry."""

    session_id: str
    group_id: str
    prompt_id: str = ""
    attempt: int = 0


@dataclass(frozen=True)
class KeySigner:
    """Mints and reads the keys of one run: ``secret`` signs, ``run_id`` binds, ``ttl_s`` bounds their life
    (times are Unix seconds, given by the caller)."""

    secret: str
    run_id: str
    ttl_s: float

    def mint(self, key: SessionKey, now: float) -> str:
        """The credential for ``key``, valid in this run until ``now + ttl_s``."""
        payload = json.dumps(
            {"s": key.session_id, "g": key.group_id, "p": key.prompt_id, "a": key.attempt, "r": self.run_id,
             "e": int(now + self.ttl_s)},
            separators=(",", ":"), ensure_ascii=False,
        ).encode()
        return f"{PREFIX}{_b64(payload)}.{_b64(self._tag(payload))}"

    def read(self, text: str, now: float) -> SessionKey:
        """The session ``text`` stands for; :class:`BadSessionKey` saying why it does not stand for one."""
        if not is_key(text):
            raise BadSessionKey(f"not a session key (those start with {PREFIX!r})")
        body, dot, tag = text[len(PREFIX):].partition(".")
        try:
            payload, got = _unb64(body), _unb64(tag)
        except ValueError:
            raise BadSessionKey("a session key that is not canonical base64url") from None
        if not dot or not hmac.compare_digest(got, self._tag(payload)):
            raise BadSessionKey("a session key this deployment did not mint (or one that was altered)")
        try:
            obj = json.loads(payload)
            out = SessionKey(str(obj["s"]), str(obj["g"]), str(obj["p"]), int(obj["a"]))
            run, expires = str(obj["r"]), int(obj["e"])
        except (ValueError, KeyError, TypeError):
            raise BadSessionKey("a signed session key with an unreadable body") from None
        if not out.session_id or out.attempt < 0:
            raise BadSessionKey("a signed session key without a session id")
        if run != self.run_id:
            raise BadSessionKey(f"a session key minted for another run ({run!r}, this is {self.run_id!r})")
        if now >= expires:
            raise BadSessionKey(f"a session key that expired {now - expires:.0f} s ago")
        return out

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self.secret.encode(), payload, hashlib.sha256).digest()


def is_key(text: str) -> bool:
    """Whether ``text`` has the shape of a session key (it may still fail :meth:`KeySigner.read`)."""
    return text.startswith(PREFIX)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """The bytes of canonical unpadded base64url ``text``; ValueError for any other spelling of them."""
    if not text.isascii():
        raise ValueError("not ascii")
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except binascii.Error as exc:
        raise ValueError(str(exc)) from None
    if _b64(raw) != text:  # unused low bits set, or padding written out: another spelling of the same bytes
        raise ValueError("not canonical")
    return raw
