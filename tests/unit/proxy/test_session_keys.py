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
