"""Bad input against real processes: a fuzzed proxy, poison records on every consumed topic, admin refusals.

One engine and one proxy subprocess per module (real Kafka, fresh topics):

- **Proxy fuzz** (hypothesis, derandomized, fixed example counts): chat-completion calls
  with valid and invalid JSON shapes, wrong types, huge / negative / non-integer budgets,
  unknown roles, empty messages, odd or missing headers, non-UTF-8 bytes, oversize bodies,
  wrong content types, each with the runner's credential, an agent's session key, the admin token, a wrong one
  or none; and control-plane calls (open, finish, pause, resume, state, models,
  health, metrics) with fuzzed bodies and authorization headers. Every answer must be one of
  the documented statuses (200, 400, 401, 403, 404, 409, 413, 422; 502 only with one of the three
  staleness errors; 503 only ``engine_unavailable`` / ``engine_lost`` / ``kafka_unavailable``), never a 500,
  and the proxy must still answer ``/health`` afterwards.
- **Admin endpoints** refuse a missing or wrong bearer token (and do nothing);
  **the engine** refuses a weight path outside its weights directory (absolute, ``..``,
  symlink) and keeps serving its version.
- **Poison records** on the topics the trainer (``train.batches``, and ``rollout.groups``
  by reference), the weight broadcaster (``weights``) and the rollout runner
  (``rollout.retries``) consume: garbage bytes, a non-map envelope, a tombstone, a wrong
  schema version, an unknown record type, invalid fields and an oversize record are counted
  in ``rein_bus_decode_errors_total{topic,reason}``, skipped, the process stays alive and
  a valid record sent afterwards is processed. (The collector's topics are covered by
  ``tests/integration/collector/test_window.py``.)

Figures (inputs tried, statuses seen, records injected) are printed by each test
(``pytest -s``) and summarised in ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from ops.local.ports import free_port
from shared.bus import Consumer, Delivered, Producer, create_topics
from shared.codec import SCHEMA_VERSION
from shared.names import Topics
from shared.policy import PolicyConfig
from shared.schemas import (
    BatchManifest,
    CompletedGroup,
    GapInfo,
    GroupDispatched,
    GroupRef,
    Record,
    RetryRequest,
    Segment,
    Trajectory,
    WeightApplied,
    WeightPublished,
    WindowInfo,
)
from shared.settings import KafkaSettings
from shared.tokenizer import TOKENIZER
from tests.support.procs import Proc, start_service
from tests.support.stack import Engine, ProxyProcess, engine_and_proxy
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.integration,
]

ADMIN = "fault-suite-admin-token"
CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size)
MAX_BODY = 8192
"""The proxy's REIN_MAX_BODY_BYTES here: oversize bodies are cheap to send."""
MAX_RECORD = 64 * 1024
"""REIN_KAFKA__MAX_RECORD_BYTES of the consumers under test: an oversize record is ~100 KiB."""

STALENESS_502 = {"partial_rollout_staleness_exceeded", "trajectory_version_changed", "generation_preempted"}
DEPENDENCY_503 = {"engine_unavailable", "engine_lost", "kafka_unavailable"}
PLAIN_OK = {200, 400, 401, 403, 404, 409, 413, 422}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as ``{(sample name, sorted labels): value}``."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    text = httpx.get(url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def decode_errors(metrics_url: str, topic: str) -> dict[str, float]:
    """``rein_bus_decode_errors_total`` of one topic, by reason."""
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in scrape(metrics_url).items()
        if name == "rein_bus_decode_errors_total" and dict(labels).get("topic") == topic
    }


# --------------------------------------------------------------------------- poison records


def poison(record_type: str) -> dict[str, tuple[str, bytes | None]]:
    """Malformed wire records for a topic whose records are ``record_type``: name -> (expected reason, value)."""
    pack = lambda obj: msgpack.packb(obj, use_bin_type=True)  # noqa: E731
    return {
        "garbage": ("not_msgpack", b"\xc1\xff\x00 this is not msgpack"),
        "truncated": ("not_msgpack", pack({"schema": SCHEMA_VERSION, "type": record_type, "data": {}})[:-3]),
        "not_a_map": ("bad_envelope", pack([SCHEMA_VERSION, record_type, {}])),
        "no_data": ("bad_envelope", pack({"schema": SCHEMA_VERSION, "type": record_type})),
        "tombstone": ("empty", None),
        "schema_version": ("schema_version", pack({"schema": SCHEMA_VERSION + 98, "type": record_type, "data": {}})),
        "unknown_type": ("unknown_type", pack({"schema": SCHEMA_VERSION, "type": "no_such_record", "data": {}})),
        "invalid_fields": ("invalid_fields", pack({"schema": SCHEMA_VERSION, "type": record_type,
                                                    "data": {"index": "not a number", "bogus": [1, 2]}})),
        "oversize": ("oversize", pack({"schema": SCHEMA_VERSION, "type": record_type,
                                       "data": {"pad": "x" * (MAX_RECORD + 40_000)}})),
    }


def inject(bootstrap: str, topic: str, values: list[bytes | None], key: bytes = b"poison") -> None:
    """Produce raw values (acks=all); a larger max_request_size than the services' so oversize gets through."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=1024 * 1024)
    try:
        for value in values:
            producer.send(topic, key=key, value=value).get(timeout=30)
    finally:
        producer.close(timeout=10)


def expected_reasons(records: dict[str, tuple[str, bytes | None]]) -> dict[str, float]:
    return dict(Counter(reason for reason, _ in records.values()))


INJECTED: Counter[str] = Counter()
"""Poison records produced per topic role, for the printed figures."""


def inject_poison(bootstrap: str, topic: str, record_type: str, role: str) -> dict[str, tuple[str, bytes | None]]:
    """Every :func:`poison` record of ``record_type`` on ``topic``, counted under ``role``; the records."""
    records = poison(record_type)
    inject(bootstrap, topic, [v for _, v in records.values()])
    INJECTED[role] += len(records)
    return records


def send(bootstrap: str, topic: str, record: Record) -> Delivered:
    """One valid record, through the services' own producer."""
    producer = Producer(KafkaSettings(bootstrap_servers=bootstrap), client_suffix="fault-test")
    try:
        return producer.send(topic, record)
    finally:
        producer.close()


@contextmanager
def service(name: str, module: str, env: dict[str, str], log_dir: Path, *, start_timeout_s: float = 60,
            stop_timeout_s: float = 20) -> Iterator[tuple[Proc, str]]:
    """``python -m module`` with ``env`` on a free metrics port: (the process, its base URL). Stopped on the
    way out by SIGTERM, after which it must have exited 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_service(module, {**env, "REIN_METRICS_PORT": str(port)}, f"{url}/health", timeout_s=start_timeout_s,
                         log_dir=log_dir)
    try:
        yield proc, url
    finally:
        code = proc.stop(timeout_s=stop_timeout_s)
    assert code == 0, f"{name} exited {code} on SIGTERM; log:\n{proc.tail()}"


# --------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    bootstrap: str
    engine_proc: Engine
    proxy_proc: ProxyProcess
    topics: Topics

    @property
    def engine(self) -> str:
        return self.engine_proc.url

    @property
    def proxy(self) -> str:
        return self.proxy_proc.url

    @property
    def weights_dir(self) -> Path:
        return self.engine_proc.weights_dir

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


@pytest.fixture(scope="module")
def stack(
    kafka_bootstrap: str, kafka_admin: KafkaAdminClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(chunks=f"t.fault.chunks.{suffix}", events=f"t.fault.events.{suffix}")
    create_topics(kafka_admin, {topics.chunks: 4, topics.events: 4})
    with engine_and_proxy(
        kafka_bootstrap, topics, tmp_path_factory.mktemp("fault-weights"), tmp_path_factory.mktemp("fault-logs"),
        admin_token=ADMIN, proxy_env={"REIN_MAX_BODY_BYTES": str(MAX_BODY), "REIN_DEFAULT_MAX_TOKENS": "8"},
    ) as (engine, proxy):
        yield Stack(kafka_bootstrap, engine, proxy, topics)


# --------------------------------------------------------------------------- proxy fuzz: strategies

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


def _unpause(client: httpx.Client) -> None:
    """A fuzzed pause with the right token would hold every later chat call: resume at once."""
    if client.get("/health").json().get("paused"):
        assert client.post("/v1/rollout/resume", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_fuzz_chat_completions_only_documented_statuses(stack: Stack) -> None:
    seen: Counter[str] = Counter()
    with httpx.Client(base_url=stack.proxy, timeout=60) as client:

        @FUZZ
        @given(call=chat_calls())
        def one(call: tuple[dict[str, bytes], bytes]) -> None:
            headers, body = call
            headers = {k: stack.credentials(v.decode("latin-1")).encode("latin-1") for k, v in headers.items()}
            check_answer(client.post("/v1/chat/completions", headers=headers, content=body), seen)

        one()
        assert stack.proxy_proc.proc.alive(), stack.proxy_proc.proc.tail()
        assert stack.healthy()
    print(f"\nchat fuzz: {sum(seen.values())} calls, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= 150
    assert seen["200"] > 0, "no fuzzed call reached the engine: the generator lost its valid shapes"


def test_fuzz_control_plane_only_documented_statuses(stack: Stack) -> None:
    seen: Counter[str] = Counter()
    with httpx.Client(base_url=stack.proxy, timeout=60) as client:

        @FUZZ
        @given(call=control_calls())
        def one(call: tuple[str, str, dict[str, bytes], bytes]) -> None:
            method, path, headers, body = call
            headers = {k: stack.credentials(v.decode("latin-1")).encode("latin-1") for k, v in headers.items()}
            try:
                check_answer(client.request(method, path, headers=headers, content=body), seen)
            finally:
                _unpause(client)

        one()
        assert stack.proxy_proc.proc.alive(), stack.proxy_proc.proc.tail()
        assert stack.healthy() and not client.get("/health").json()["paused"]
    print(f"\ncontrol fuzz: {sum(seen.values())} calls, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= 150


# --------------------------------------------------------------------------- admin and weight paths

BAD_AUTH: list[dict[str, str]] = [
    {},
    {"authorization": ""},
    {"authorization": "Bearer"},
    {"authorization": "Bearer\t\tx"},
    {"authorization": "Bearer wrong-token-0123"},
    {"authorization": f"Bearer {ADMIN[:-1]}"},
    {"authorization": f"Bearer {ADMIN}0"},
    {"authorization": f"Basic {ADMIN}"},
    {"authorization": ADMIN},
    {"x-admin-token": ADMIN},
]


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/rollout/pause"), ("POST", "/v1/rollout/resume"),
                                              ("GET", "/v1/rollout/state")])
def test_admin_endpoints_refuse_missing_and_wrong_tokens(stack: Stack, method: str, path: str) -> None:
    with httpx.Client(base_url=stack.proxy, timeout=30) as client:
        for headers in BAD_AUTH:
            r = client.request(method, path, headers=headers, content=b"{}" if method == "POST" else b"")
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["detail"]["error"] == "unauthorized"
            assert client.get("/health").json()["paused"] is False, f"a refused {path} changed the proxy"
        ok = client.request(method, path, headers={"authorization": f"Bearer {ADMIN}"},
                            content=b"{}" if method == "POST" else b"")
        assert ok.status_code == 200, ok.text
        _unpause(client)


def test_engine_refuses_weight_paths_outside_its_weights_dir(stack: Stack, tmp_path: Path) -> None:
    before = httpx.get(f"{stack.engine}/get_model_info", timeout=10).json()
    outside, _ = stack.checkpoint("v-outside", seed=7, where=tmp_path)  # a real, loadable checkpoint
    link = stack.weights_dir / f"link-{uuid.uuid4().hex[:6]}.pt"
    link.symlink_to(outside)
    relative = os.path.relpath(outside, stack.weights_dir)  # ../../.../v-outside-*.pt
    for bad in [str(outside), relative, f"{stack.weights_dir}/../{outside.parent.name}/{outside.name}", link.name,
                str(link), "/etc/hostname", "/", ""]:
        r = httpx.post(f"{stack.engine}/update_weights_from_disk",
                       json={"model_path": bad, "weight_version": "v-evil"}, timeout=30)
        assert r.status_code in (400, 422), (bad, r.text)  # 422: the empty path fails the schema first
        assert r.status_code == 422 or r.json()["success"] is False, (bad, r.text)
    after = httpx.get(f"{stack.engine}/get_model_info", timeout=10).json()
    assert (after["weight_version"], after["digest"]) == (before["weight_version"], before["digest"])
    inside, digest = stack.checkpoint("v-inside", seed=8)
    r = httpx.post(f"{stack.engine}/update_weights_from_disk",
                   json={"model_path": inside.name, "weight_version": "v-inside"}, timeout=30)
    assert r.status_code == 200 and r.json()["digest"] == digest, r.text


# --------------------------------------------------------------------------- poison records per consumer


def _group(group_id: str) -> CompletedGroup:
    trajs = [
        Trajectory(
            session_id=f"{group_id}-s{k}", status="completed", reward=reward,
            segments=[Segment(segment_index=0, token_ids=[3 + (k + j) % 20 for j in range(10)],
                              loss_mask=[0] * 4 + [1] * 6, logprobs=[0.0] * 4 + [-2.0] * 6,
                              versions=[None] * 4 + ["v0"] * 6)],
        )
        for k, reward in enumerate([1.0, 0.0])
    ]
    return CompletedGroup(group_id=group_id, prompt_id=f"p-{group_id}", failed=False, trajectories=trajs)


def _manifest(index: int, refs: list[GroupRef]) -> BatchManifest:
    return BatchManifest(batch_id=f"b{index}-{uuid.uuid4().hex[:6]}", index=index, groups=refs,
                         window=WindowInfo(keep_versions=2, current_version="v0", current_index=0, cutoff_index=0),
                         version_gap=GapInfo(min=0, max=0, mean=0.0), drops_in_batch=0, drops_cumulative=0)


def test_trainer_skips_and_counts_poison_manifests_and_group_records(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    topics = Topics(groups=unique_topic(1), batches=unique_topic(1), weights=unique_topic(1))
    bad_batches = inject_poison(kafka_bootstrap, topics.batches, "batch", "train.batches")
    # rollout.groups is read by reference: one good group, one garbage record a manifest points at.
    good = send(kafka_bootstrap, topics.groups, _group("g-good"))
    inject(kafka_bootstrap, topics.groups, [b"\xc1 garbage group"], key=b"g-bad")
    INJECTED["rollout.groups"] += 1
    bad_ref = GroupRef(group_id="g-bad", partition=0, offset=good.offset + 1)
    send(kafka_bootstrap, topics.batches, _manifest(0, [GroupRef(group_id="g-good", partition=0, offset=good.offset),
                                                        bad_ref]))
    with service(
        "trainer",
        "services.trainer",
        {
            "REIN_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
            "REIN_KAFKA__MAX_RECORD_BYTES": str(MAX_RECORD),
            "REIN_TOPICS__GROUPS": topics.groups,
            "REIN_TOPICS__BATCHES": topics.batches,
            "REIN_TOPICS__WEIGHTS": topics.weights,
            "REIN_WEIGHTS_DIR": str(tmp_path / "weights"),
            "REIN_RUN_DIR": str(tmp_path / "run"),
            "REIN_CONSUMER_GROUP": unique_group,
            "REIN_TORCH_THREADS": "1",
            "REIN_FETCH_TIMEOUT_S": "20",
            "REIN_LOG_LEVEL": "warning",
        },
        tmp_path / "logs",
    ) as (proc, url):
        metrics_url = f"{url}/metrics"
        lines_path = tmp_path / "run" / "metrics.jsonl"
        wait_until(lambda: lines_path.exists() and lines_path.read_text().strip(), 60, "step 1 (manifest 0)", proc)
        want = expected_reasons(bad_batches)
        wait_until(lambda: decode_errors(metrics_url, topics.batches) == want, 30, f"decode errors {want}", proc)
        line = json.loads(lines_path.read_text().splitlines()[0])
        assert (line["manifest_index"], line["bad_group_refs"]) == (0, 1), line
        assert scrape(metrics_url)[("rein_trainer_bad_group_refs_total", ())] == 1
        # A manifest whose every reference is unusable must not kill the trainer either.
        send(kafka_bootstrap, topics.batches, _manifest(1, [bad_ref]))
        wait_until(lambda: scrape(metrics_url)[("rein_trainer_bad_group_refs_total", ())] == 2, 30,
                   "manifest 1 (only unusable refs) handled", proc)
        assert proc.alive(), proc.tail()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    print(f"\ntrainer: injected {len(bad_batches)} on train.batches + 1 on rollout.groups; skipped and counted")


def test_broadcaster_skips_and_counts_poison_weight_records(
    stack: Stack, unique_topic: Callable[..., str], unique_group: str, redis_db_url: str, tmp_path: Path
) -> None:
    weights_topic = unique_topic(1)
    bad = inject_poison(stack.bootstrap, weights_topic, "weight_published", "weights")
    path, digest = stack.checkpoint("v-after-poison", seed=11)
    event = WeightPublished(version="v-after-poison", seq=1, path=str(path), digest=digest, step=1)
    send(stack.bootstrap, weights_topic, event)
    kafka = KafkaSettings(bootstrap_servers=stack.bootstrap)
    with service(
        "broadcaster",
        "services.weight_broadcaster",
        {
            "REIN_KAFKA__BOOTSTRAP_SERVERS": stack.bootstrap,
            "REIN_KAFKA__MAX_RECORD_BYTES": str(MAX_RECORD),
            "REIN_REDIS__URL": redis_db_url,
            "REIN_REDIS__KEY_PREFIX": f"fault-{uuid.uuid4().hex[:6]}",
            "REIN_TOPICS__WEIGHTS": weights_topic,
            "REIN_PROXY_URLS": json.dumps([stack.proxy]),
            "REIN_ENGINE_URLS": json.dumps([stack.engine]),
            "REIN_ADMIN_TOKEN": ADMIN,
            "REIN_CONSUMER_GROUP": unique_group,
            "REIN_LOG_LEVEL": "warning",
        },
        tmp_path / "logs",
    ) as (proc, url):
        metrics_url = f"{url}/metrics"
        wait_until(lambda: httpx.get(f"{stack.engine}/get_model_info", timeout=10).json()["digest"] == digest, 60,
                   "the valid version after the poison to reach the engine", proc)
        reader = Consumer(kafka, [weights_topic], f"{unique_group}-reader", client_suffix="fault-reader")
        try:
            wait_until(lambda: any(isinstance(p.record, WeightApplied) and p.record.version == event.version
                                   for p in reader.poll(0.5)), 30, "WeightApplied", proc)
        finally:
            reader.close()
        want = expected_reasons(bad)
        wait_until(lambda: decode_errors(metrics_url, weights_topic) == want, 30, f"decode errors {want}", proc)
        assert proc.alive(), proc.tail()
        assert httpx.get(f"{stack.proxy}/health", timeout=10).json()["paused"] is False


def test_rollout_runner_skips_and_counts_poison_retry_records(
    stack: Stack, unique_topic: Callable[..., str], unique_group: str, redis_db_url: str, tmp_path: Path
) -> None:
    retries = unique_topic()
    bad = inject_poison(stack.bootstrap, retries, "retry", "rollout.retries")
    payload = {"task": "guess_number", "secret": 3, "low": 0, "high": 15, "max_turns": 2}
    retry = RetryRequest(prompt_id=f"gn-fault-{uuid.uuid4().hex[:6]}", attempt=1, previous_group_id="g-old",
                         prompt=payload)
    send(stack.bootstrap, retries, retry)
    kafka = KafkaSettings(bootstrap_servers=stack.bootstrap)
    with service(
        "rollout runner",
        "services.rollout",
        {
            "REIN_PROXY_URL": stack.proxy,
            "REIN_RUNNER_TOKEN": stack.proxy_proc.runner_token,
            "REIN_KAFKA__BOOTSTRAP_SERVERS": stack.bootstrap,
            "REIN_KAFKA__MAX_RECORD_BYTES": str(MAX_RECORD),
            "REIN_TOPICS__EVENTS": stack.topics.events,
            "REIN_TOPICS__CHUNKS": stack.topics.chunks,
            "REIN_TOPICS__RETRIES": retries,
            "REIN_TOPICS__WEIGHTS": unique_topic(),
            "REIN_RETRY_CONSUMER_GROUP": unique_group,
            "REIN_REDIS__URL": redis_db_url,
            "REIN_GROUP_SIZE": "1",
            "REIN_MAX_CONCURRENT_GROUPS": "1",
            "REIN_REQUEST_TIMEOUT_S": "30",
            "REIN_STARTUP_TIMEOUT_S": "60",
            "REIN_LOG_LEVEL": "warning",
        },
        tmp_path / "logs",
        start_timeout_s=90,
        stop_timeout_s=60,
    ) as (proc, url):
        metrics_url = f"{url}/metrics"
        want = expected_reasons(bad)
        wait_until(lambda: decode_errors(metrics_url, retries) == want, 60, f"decode errors {want}", proc)
        wait_until(lambda: scrape(metrics_url).get(("rein_rollout_groups_dispatched_total", (("kind", "retry"),)))
                   == 1, 60, "the valid retry after the poison to be dispatched", proc)
        reader = Consumer(kafka, [stack.topics.events], f"{unique_group}-reader", client_suffix="fault-reader")
        try:
            wait_until(lambda: any(isinstance(p.record, GroupDispatched) and p.record.prompt_id == retry.prompt_id
                                   and p.record.attempt == 1 for p in reader.poll(0.5)), 30, "GroupDispatched", proc)
        finally:
            reader.close()
        assert proc.alive(), proc.tail()
    print(f"\npoison records injected per topic so far: {dict(INJECTED)}")


# --------------------------------------------------------------------------- edge inputs found by hand

EDGE_CALLS: dict[str, tuple[str, dict[str, bytes], bytes]] = {
    "attempt_superscript_digit": ("/v1/chat/completions", {"x-session-id": b"edge-1", "x-attempt": b"\xb2"},
                                  b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'),
    "chat_deeply_nested_json": ("/v1/chat/completions", {"x-session-id": b"edge-2"},
                                b'{"messages":' + b"[" * 3000 + b"]" * 3000 + b"}"),
    "finish_deeply_nested_json": ("/v1/sessions/edge-3/finish", {}, b"[" * 3000),
    "lone_surrogate_content": ("/v1/chat/completions", {"x-session-id": b"edge-4"},
                               b'{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}'),
    "lone_surrogate_session": ("/v1/chat/completions", {"x-session-id": b"edge-\xed\xa0\x80"},
                               b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'),
    "nan_temperature": ("/v1/chat/completions", {"x-session-id": b"edge-5"},
                        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"temperature":NaN}'),
}


@pytest.mark.parametrize("name", sorted(EDGE_CALLS))
def test_edge_inputs_are_documented_answers(stack: Stack, name: str) -> None:
    path, headers, body = EDGE_CALLS[name]
    with stack.runner() as client:
        if path.endswith("/finish"):  # a real session to finish, so the body is what decides
            _open_session(client, path.split("/")[3])
        r = client.post(path, headers=headers, content=body)
        print(f"\n{name}: {r.status_code} {r.text[:160]}")
        check_answer(r, Counter())
        assert stack.healthy()


def _open_session(client: httpx.Client, sid: str) -> None:
    """One generation in a trainable session (it has a group id), so a finish would be published."""
    r = client.post("/v1/chat/completions", headers={"x-session-id": sid, "x-group-id": f"grp-{sid}"},
                    content=b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("reward", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_reward_is_refused_not_published(stack: Stack, reward: bytes) -> None:
    """A NaN / infinite reward would reach GRPO's advantages through rollout.events and poison the update."""
    sid = f"edge-reward-{uuid.uuid4().hex[:6]}"
    with stack.runner() as client:
        _open_session(client, sid)
        r = client.post(f"/v1/sessions/{sid}/finish", content=b'{"reward": ' + reward + b"}")
        assert r.status_code == 422, f"reward {reward!r} accepted: {r.status_code} {r.text}"
        ok = client.post(f"/v1/sessions/{sid}/finish", content=b'{"reward": 0.5}')
        assert ok.status_code == 200 and ok.json()["published"] is True, ok.text
