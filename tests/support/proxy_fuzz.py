"""Fuzzed calls to a proxy and the check of their answers, for the bad-input suite
(``tests/integration/test_fault_bad_input.py``).

- hypothesis strategies: chat-completion calls (:func:`chat_calls`: headers and body, about a third of the bodies
  well-formed) and control-plane calls (:func:`control_calls`: method, path, headers and body), with
  credentials as placeholders (``<runner>``, ``<key>``) the test fills in;
- :data:`FUZZ`: the deterministic settings every fuzz runs with;
- :func:`check_answer`: only the documented statuses, 502 and 503 only with their documented error kinds;
  :func:`unpause`: a fuzzed pause undone at once;
- :class:`BadInputStack`: the engine and proxy under fuzz, which fills the placeholders in.

:data:`ADMIN` and :data:`MAX_BODY` are the proxy's admin token and body limit the strategies are built for: the
suite starts its proxy with them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from shared.names import Topics
from tests.support.stack import Engine, ProxyProcess

ADMIN = "fault-suite-admin-token"
"""The proxy's admin token (REIN_ADMIN_TOKEN): fuzzed credentials try it right and wrong."""
MAX_BODY = 8192
"""The proxy's REIN_MAX_BODY_BYTES here: oversize bodies are cheap to send."""

STALENESS_502 = {"partial_rollout_staleness_exceeded", "trajectory_version_changed", "generation_preempted"}
DEPENDENCY_503 = {"engine_unavailable", "engine_lost", "kafka_unavailable"}
PLAIN_OK = {200, 400, 401, 403, 404, 409, 413, 422}
"""The documented statuses of an answer that is not a 5xx."""


@dataclass
class BadInputStack:
    """The suite's engine and proxy processes (one of each per module) and the topics the proxy publishes to;
    ``engine`` and ``proxy`` are their base URLs, ``weights_dir`` the directory the engine loads from."""

    bootstrap: str
    engine_proc: Engine
    proxy_proc: ProxyProcess
    topics: Topics
    engine: str = field(init=False)
    proxy: str = field(init=False)
    weights_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.engine, self.proxy = self.engine_proc.url, self.proxy_proc.url
        self.weights_dir = self.engine_proc.weights_dir

    def healthy(self) -> bool:
        return self.proxy_proc.healthy()

    def runner(self) -> httpx.Client:
        """A client with the runner's credential."""
        return httpx.Client(base_url=self.proxy, timeout=60,
                            headers={"authorization": f"Bearer {self.proxy_proc.runner_token}"})

    def credentials(self, text: str) -> str:
        """``text`` with its placeholders ``<runner>`` and ``<key>`` (an agent's session key) filled in."""
        if "<key>" in text:
            with self.runner() as runner:
                key = runner.post("/v1/sessions", json={"group_id": "fuzz-key"}).json()["api_key"]
            text = text.replace("<key>", key)
        return text.replace("<runner>", self.proxy_proc.runner_token)

    def checkpoint(self, version: str, seed: int, where: Path | None = None) -> tuple[Path, str]:
        return self.engine_proc.checkpoint(version, seed, where)


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
json_values = st.recursive(
    _json_leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12,
)
short_text = st.one_of(st.sampled_from(["hi", "guess", "5", "", " ", "<|end|>", "é", "\u0000", "\U0001f600"]),
                       st.text(max_size=30))
roles = st.one_of(st.sampled_from(["system", "user", "assistant"]),
                  st.sampled_from(["tool", "function", "developer", "USER", "", None, 3, ["user"]]))
contents = st.one_of(
    short_text,
    st.none(),
    st.text(min_size=200, max_size=400),  # past the tiny policy's context window
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]), "text": short_text}),
             max_size=3),
    json_values,
)
message = st.one_of(st.fixed_dictionaries({"role": roles, "content": contents}), json_values)
messages = st.one_of(st.lists(message, max_size=4), st.just([]), json_values)
budgets = st.one_of(
    st.none(), st.integers(min_value=-5, max_value=12),
    st.sampled_from([0, 2**31, 2**63, -(2**63), 10**30, 1.5, "8", True]),
)
floats_any = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
                       st.sampled_from([0.0, 1.0, 2.0, 2.5, -0.1, "1"]))
chat_body = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        "model": st.one_of(st.text(max_size=10), json_values),
        "max_tokens": budgets,
        "max_completion_tokens": budgets,
        "temperature": floats_any,
        "top_p": floats_any,
        "top_k": st.one_of(budgets, st.integers(min_value=-(2**40), max_value=2**40)),
        "ignore_eos": st.one_of(st.booleans(), json_values),
        "stream": st.one_of(st.booleans(), st.sampled_from([0, 1, "yes", None])),
        "n": st.one_of(st.integers(-1, 3), json_values),
        "stop": json_values,
        "tools": json_values,
    },
)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()  # NaN / Infinity are what a sloppy client sends


header_text = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"),
                      max_size=12)
"""Latin-1 printable header values (what HTTP/1.1 can carry), sent as raw bytes."""
session_ids = st.one_of(st.sampled_from(["fuzz-a", "fuzz-b", "fuzz-c"]), header_text)
attempts = st.one_of(st.sampled_from(["0", "1", "2", "-1", "x", "", "1.5", "99999999999999999999"]), header_text)
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", ""])

valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                  "content": st.sampled_from(["hi", "guess", "5", ""])}),
                          min_size=1, max_size=2)},
    optional={"max_tokens": st.one_of(st.integers(1, 6), st.sampled_from([2**31, 10**30])),
              "temperature": st.sampled_from([0.0, 1.0]), "top_k": st.sampled_from([-1, 0, 1, 2**40, -(2**40)]),
              "top_p": st.sampled_from([0.5, 1.0]), "ignore_eos": st.booleans(), "stream": st.booleans()},
)
"""Well-formed calls (about a third of the bodies), so sessions, budgets and sampling reach the engine."""
chat_bodies = st.one_of(
    valid_chat.map(_dumps),
    valid_chat.map(_dumps),
    chat_body.map(_dumps),
    json_values.map(_dumps),
    st.binary(max_size=64),
    st.just(b'{"messages":[{"role":"user","content":"\xff\xfe\xc3"}]}'),  # not UTF-8
    st.just(b" " * (MAX_BODY + 1)),  # oversize
    st.just(b""),
)


@st.composite
def chat_calls(draw: st.DrawFn) -> tuple[dict[str, bytes], bytes]:
    headers: dict[str, bytes] = {}
    auth = draw(st.sampled_from(["Bearer <runner>"] * 12 + [None, f"Bearer {ADMIN}", "Bearer <key>",
                                                            "Bearer wrong-token-000"]))
    if auth is not None:
        headers["authorization"] = auth.encode()
    # the runner names its session by header (now and then it forgets); the others may or may not
    sid = draw(st.one_of(session_ids, session_ids, session_ids, st.none()) if auth == "Bearer <runner>" else
               st.one_of(st.none(), session_ids))
    if sid is not None:
        headers["x-session-id"] = sid.encode("latin-1")
    for name, strat in (("x-attempt", attempts), ("x-group-id", header_text), ("x-turn-id", header_text),
                        ("x-rein-soft-reject", st.sampled_from(["1", "0", "true", "no"])),
                        ("content-type", content_types)):
        if draw(st.booleans()):
            headers[name] = draw(strat).encode("latin-1")
    return headers, draw(chat_bodies)


auth_headers = st.one_of(
    st.none(),
    st.sampled_from([f"Bearer {ADMIN}", f"bearer   {ADMIN}", "Bearer", f"Basic {ADMIN}", ADMIN,
                     f"Bearer {ADMIN[:-1]}", f"Bearer {ADMIN}x", "Bearer wrong-token-000", "Bearer <runner>",
                     "Bearer <runner>", "Bearer <key>", "Basic <runner>"]),
    header_text.map(lambda t: f"Bearer {t}"),
)
control_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={"reward": floats_any, "status": st.one_of(
        st.sampled_from(["completed", "truncated", "failed", "bogus"]), json_values)}).map(_dumps),
    st.fixed_dictionaries({}, optional={"reason": json_values, "timeout_s": floats_any}).map(_dumps),
    json_values.map(_dumps),
    st.binary(max_size=32),
    st.just(b""),
)


@st.composite
def control_calls(draw: st.DrawFn) -> tuple[str, str, dict[str, bytes], bytes]:
    kind = draw(st.sampled_from(["finish", "open", "pause", "resume", "state", "models", "health", "metrics"]))
    headers: dict[str, bytes] = {}
    auth = draw(auth_headers)
    if auth is not None:
        headers["authorization"] = auth.strip().encode("latin-1")  # HTTP/1.1 forbids trailing blanks
    body = draw(control_bodies)
    if kind == "finish":
        sid = draw(st.one_of(st.sampled_from(["fuzz-a", "fuzz-b", "fuzz-c", "never-seen"]),
                             st.text(min_size=1, max_size=12)))
        return "POST", f"/v1/sessions/{quote(sid, safe='')}/finish", headers, body
    if kind == "open":
        return "POST", "/v1/sessions", headers, draw(st.one_of(control_bodies, st.fixed_dictionaries(
            {"group_id": st.text(max_size=8)}, optional={"attempt": json_values}).map(_dumps)))
    if kind in ("pause", "resume"):
        return "POST", f"/v1/rollout/{kind}", headers, body
    if kind == "state":
        return "GET", "/v1/rollout/state", headers, b""
    return "GET", {"models": "/v1/models", "health": "/health", "metrics": "/metrics"}[kind], headers, b""


FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def check_answer(response: httpx.Response, seen: Counter[str]) -> None:
    """The documented status set; 502 / 503 only with their documented error kinds."""
    status = response.status_code
    error = ""
    if status >= 500:
        try:
            error = str(response.json()["detail"]["error"])
        except (ValueError, KeyError, TypeError):
            error = f"<unparsed: {response.text[:200]!r}>"
    seen[f"{status} {error}".strip()] += 1
    if status == 502:
        assert error in STALENESS_502, f"undocumented 502: {response.text[:500]}"
    elif status == 503:
        assert error in DEPENDENCY_503, f"undocumented 503: {response.text[:500]}"
    else:
        assert status in PLAIN_OK, f"undocumented status {status}: {response.text[:500]}"


def unpause(client: httpx.Client) -> None:
    """A fuzzed pause with the right token would hold every later chat call: resume at once."""
    if client.get("/health").json().get("paused"):
        assert client.post("/v1/rollout/resume", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
