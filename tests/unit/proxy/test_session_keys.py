"""Session keys and the proxy's credentials: what an agent's key stands for, and what each role may do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.proxy.auth import Auth, Headers
from services.proxy.session_keys import PREFIX, BadSessionKey, KeySigner, SessionKey, is_key
from shared.errors import Forbidden, MissingHeader, Unauthorized, UnknownSessionKey

SECRET = "session-key-secret-1"
NOW = 1_800_000_000.0
KEYS = KeySigner(SECRET, "run-1", ttl_s=3600)


@given(st.text(min_size=1), st.text(), st.text(), st.integers(0, 2**31))
def test_a_key_reads_back_as_the_session_it_was_minted_for(sid: str, gid: str, pid: str, attempt: int) -> None:
    key = SessionKey(sid, gid, pid, attempt)
    text = KEYS.mint(key, NOW)
    assert is_key(text) and text.isascii() and "/" not in text, "fits a header and a URL path"
    assert KEYS.read(text, NOW) == key


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("sk-openai-key", "not a session key"),
        (PREFIX, "did not mint"),
        (PREFIX + "e30.", "did not mint"),
        (PREFIX + "!!!.???", "not canonical"),
        (PREFIX + "ünï.cödé", "not canonical"),
    ],
)
def test_what_is_not_a_key(text: str, why: str) -> None:
    with pytest.raises(BadSessionKey, match=why):
        KEYS.read(text, NOW)


def test_an_altered_key_or_another_deployments_is_refused() -> None:
    text = KEYS.mint(SessionKey("s", "g"), NOW)
    body, tag = text[len(PREFIX):].split(".")
    other = KEYS.mint(SessionKey("s2", "g"), NOW)[len(PREFIX):].split(".")[0]
    with pytest.raises(BadSessionKey, match="did not mint"):
        KEYS.read(f"{PREFIX}{other}.{tag}", NOW)  # another session's body under this tag
    with pytest.raises(BadSessionKey, match="did not mint"):
        KeySigner("another-secret-of-16", "run-1", 3600).read(text, NOW)
    with pytest.raises(BadSessionKey, match="did not mint"):
        KEYS.read(f"{PREFIX}{body}", NOW)  # no tag


def test_a_key_of_another_run_or_past_its_life_is_refused() -> None:
    text = KEYS.mint(SessionKey("s", "g"), NOW)
    with pytest.raises(BadSessionKey, match="another run"):
        KeySigner(SECRET, "run-2", 3600).read(text, NOW)  # yesterday's key, today's run, the same secret
    assert KEYS.read(text, NOW + 3599) == SessionKey("s", "g")
    with pytest.raises(BadSessionKey, match="expired"):
        KEYS.read(text, NOW + 3600)


@pytest.mark.parametrize("where", range(0, 60, 7))
@pytest.mark.parametrize("extra", ["!", "=", " ", "+", "\n", "=="])
def test_only_the_canonical_spelling_of_a_key_reads(where: int, extra: str) -> None:
    """Base64 decoders skip stray characters: a key with one inserted read as the same session while a balancer
    hashed another string (and sent it to another replica)."""
    text = KEYS.mint(SessionKey("s", "g", "p", 1), NOW)
    at = len(PREFIX) + where
    with pytest.raises(BadSessionKey):
        KEYS.read(text[:at] + extra + text[at:], NOW)


def test_a_key_with_its_last_characters_bits_changed_is_refused() -> None:
    """Base64's last character carries unused low bits: each value of them spells the same bytes."""
    text = KEYS.mint(SessionKey("s", "g"), NOW)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    others = [text[:-1] + c for c in alphabet if c != text[-1]]
    assert sum(_reads(KEYS, o) for o in others) == 0


def _reads(keys: KeySigner, text: str) -> bool:
    try:
        keys.read(text, NOW)
    except BadSessionKey:
        return False
    return True


# --------------------------------------------------------------------------- who may do what


ADMIN, RUNNER = "admin-token-0123", "runner-token-4567"
AUTH = Auth(ADMIN, RUNNER, False, KEYS, clock=lambda: NOW)


def headers(**sent: str) -> Headers:
    return Headers([(k.lower().replace("_", "-").encode(), v.encode()) for k, v in sent.items()])


def test_which_identity_a_call_carries() -> None:
    key = AUTH.mint(SessionKey("s-key", "g-key", "p", 2))

    def ids(path_key: str | None = None, **sent: str) -> tuple[str, str, str, int, str]:
        got = AUTH.call_ids(headers(**sent), path_key=path_key)
        return got.session_id, got.group_id, got.prompt_id, got.attempt, got.turn_id

    assert ids(authorization=f"Bearer {key}", x_turn_id="t") == ("s-key", "g-key", "p", 2, "t")
    assert ids(x_api_key=key) == ("s-key", "g-key", "p", 2, "")
    assert ids(path_key=key, authorization="Bearer whatever") == ("s-key", "g-key", "p", 2, "")
    # X-Session-Id is the runner's way in: with its credential
    assert ids(x_session_id="s-h", x_group_id="g-h", authorization=f"Bearer {RUNNER}") == ("s-h", "g-h", "", 0, "")
    assert ids(x_session_id="s-h", x_api_key=RUNNER) == ("s-h", "", "", 0, "")
    with pytest.raises(UnknownSessionKey, match="POST /v1/sessions"):
        ids(authorization="Bearer sk-someone-elses")
    with pytest.raises(UnknownSessionKey):
        ids(path_key="rein-sk-forged.tag", x_session_id="s-h")  # a path names its session: no fallback
    with pytest.raises(MissingHeader):
        ids()


@pytest.mark.parametrize("bearer", ["", "sk-anything", ADMIN, "RUNNER-token-4567"])
def test_a_call_by_x_session_id_without_the_runners_credential_is_401(bearer: str) -> None:
    with pytest.raises(Unauthorized, match="REIN_RUNNER_TOKEN") as caught:
        AUTH.call_ids(headers(x_session_id="s", x_group_id="g", authorization=f"Bearer {bearer}"))
    assert caught.value.status == 401


def test_an_agents_key_cannot_name_another_session_by_header() -> None:
    key = AUTH.mint(SessionKey("mine", "g"))
    with pytest.raises(Forbidden) as caught:
        AUTH.call_ids(headers(x_session_id="someone-else", authorization=f"Bearer {key}"))
    assert caught.value.status == 403


def test_opening_and_finishing_are_the_runners() -> None:
    key = AUTH.mint(SessionKey("s", "g"))
    AUTH.require_runner(headers(authorization=f"Bearer {RUNNER}"), "finishing a session")
    for sent, error in [({}, Unauthorized), ({"authorization": f"Bearer {ADMIN}"}, Unauthorized),
                        ({"authorization": f"Bearer {key}"}, Forbidden), ({"x_api_key": key}, Forbidden)]:
        with pytest.raises(error, match="finishing a session"):
            AUTH.require_runner(headers(**sent), "finishing a session")
    opened = Auth(ADMIN, "", True, KEYS, clock=lambda: NOW)
    opened.require_runner(headers(), "finishing a session")  # REIN_OPEN_SESSIONS: nothing asked
    assert opened.call_ids(headers(x_session_id="s")).session_id == "s"


def test_the_control_plane_is_the_operators() -> None:
    AUTH.require_admin(headers(authorization=f"Bearer {ADMIN}"))
    for sent in [{}, {"authorization": f"Bearer {RUNNER}"}, {"x_api_key": ADMIN}, {"authorization": ADMIN}]:
        with pytest.raises(Unauthorized, match="REIN_ADMIN_TOKEN"):
            AUTH.require_admin(headers(**sent))
