"""Session keys: what a black-box agent's API key stands for, signed with the deployment's secret."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.proxy.session_keys import PREFIX, BadSessionKey, SessionKey, is_key, mint, read

SECRET = "admin-token-1"


@given(st.text(min_size=1), st.text(), st.text(), st.integers(0, 2**31))
def test_a_key_reads_back_as_the_session_it_was_minted_for(sid: str, gid: str, pid: str, attempt: int) -> None:
    key = SessionKey(sid, gid, pid, attempt)
    text = mint(key, SECRET)
    assert is_key(text) and text.isascii() and "/" not in text, "fits a header and a URL path"
    assert read(text, SECRET) == key


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("sk-openai-key", "not a session key"),
        (PREFIX, "did not mint"),
        (PREFIX + "e30.", "did not mint"),
        (PREFIX + "!!!.???", "did not mint"),
        (PREFIX + "ünï.cödé", "not base64url"),
    ],
)
def test_what_is_not_a_key(text: str, why: str) -> None:
    with pytest.raises(BadSessionKey, match=why):
        read(text, SECRET)


def test_an_altered_key_or_another_deployments_is_refused() -> None:
    text = mint(SessionKey("s", "g"), SECRET)
    body, tag = text[len(PREFIX):].split(".")
    other = mint(SessionKey("s2", "g"), SECRET)[len(PREFIX):].split(".")[0]
    with pytest.raises(BadSessionKey, match="did not mint"):
        read(f"{PREFIX}{other}.{tag}", SECRET)  # another session's body under this tag
    with pytest.raises(BadSessionKey, match="did not mint"):
        read(text, "another-secret")
    with pytest.raises(BadSessionKey, match="did not mint"):
        read(f"{PREFIX}{body}", SECRET)  # no tag


def test_which_identity_a_call_carries() -> None:
    from services.proxy.app import _call_ids, _Headers
    from shared.errors import MissingHeader, UnknownSessionKey

    key = mint(SessionKey("s-key", "g-key", "p", 2), SECRET)

    def ids(path_key: str | None = None, **headers: str) -> tuple[str, str, str, int, str]:
        raw = [(k.lower().replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
        got = _call_ids(_Headers(raw), SECRET, path_key=path_key)
        return got.session_id, got.group_id, got.prompt_id, got.attempt, got.turn_id

    assert ids(authorization=f"Bearer {key}", x_turn_id="t") == ("s-key", "g-key", "p", 2, "t")
    assert ids(path_key=key, authorization="Bearer whatever") == ("s-key", "g-key", "p", 2, "")
    # the header wins over any API key (the rollout runner sends both)
    assert ids(x_session_id="s-h", x_group_id="g-h", authorization=f"Bearer {key}") == ("s-h", "g-h", "", 0, "")
    with pytest.raises(UnknownSessionKey, match="POST /v1/sessions"):
        ids(authorization="Bearer sk-someone-elses")
    with pytest.raises(UnknownSessionKey):
        ids(path_key="rein-sk-forged.tag", x_session_id="s-h")  # a path names its session: no fallback
    with pytest.raises(MissingHeader):
        ids()
