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
(``pytest -s``) and summarised in ``docs/reliability.md``. The fuzz strategies and the answer check are in
``tests/support/proxy_fuzz.py``, the poison records and the consumers' process harness in ``tests/support/poison.py``.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from kafka.admin import KafkaAdminClient

from shared.bus import Consumer, create_topics
from shared.names import Topics
from shared.schemas import GroupDispatched, GroupRef, RetryRequest, WeightApplied, WeightPublished
from shared.settings import KafkaSettings
from tests.support.poison import (
    INJECTED,
    decode_errors,
    expected_reasons,
    inject,
    inject_poison,
    scrape,
    send,
    service,
    valid_group,
    valid_manifest,
)
from tests.support.proxy_fuzz import (
    ADMIN,
    FUZZ,
    MAX_BODY,
    BadInputStack,
    chat_calls,
    check_answer,
    control_calls,
    unpause,
)
from tests.support.stack import engine_and_proxy
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.integration,
]


@pytest.fixture(scope="module")
def stack(
    kafka_bootstrap: str, kafka_admin: KafkaAdminClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BadInputStack]:
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(chunks=f"t.fault.chunks.{suffix}", events=f"t.fault.events.{suffix}")
    create_topics(kafka_admin, {topics.chunks: 4, topics.events: 4})
    with engine_and_proxy(
        kafka_bootstrap, topics, tmp_path_factory.mktemp("fault-weights"), tmp_path_factory.mktemp("fault-logs"),
        admin_token=ADMIN, proxy_env={"REIN_MAX_BODY_BYTES": str(MAX_BODY), "REIN_DEFAULT_MAX_TOKENS": "8"},
    ) as (engine, proxy):
        yield BadInputStack(kafka_bootstrap, engine, proxy, topics)


def test_fuzz_chat_completions_only_documented_statuses(stack: BadInputStack) -> None:
    seen: Counter[str] = Counter()
    with httpx.Client(base_url=stack.proxy, timeout=60) as client:

        @FUZZ
        @given(call=chat_calls())
        def one(call: tuple[dict[str, bytes], bytes]) -> None:
            headers, body = call
            headers = {k: stack.credentials(v.decode("latin-1")).encode("latin-1") for k, v in headers.items()}
            check_answer(client.post("/v1/chat/completions", headers=headers, content=body), seen)  # type: ignore[arg-type]

        one()
        assert stack.proxy_proc.proc.alive(), stack.proxy_proc.proc.tail()
        assert stack.healthy()
    print(f"\nchat fuzz: {sum(seen.values())} calls, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= 150
    assert seen["200"] > 0, "no fuzzed call reached the engine: the generator lost its valid shapes"


def test_fuzz_control_plane_only_documented_statuses(stack: BadInputStack) -> None:
    seen: Counter[str] = Counter()
    with httpx.Client(base_url=stack.proxy, timeout=60) as client:

        @FUZZ
        @given(call=control_calls())
        def one(call: tuple[str, str, dict[str, bytes], bytes]) -> None:
            method, path, headers, body = call
            headers = {k: stack.credentials(v.decode("latin-1")).encode("latin-1") for k, v in headers.items()}
            try:
                check_answer(client.request(method, path, headers=headers, content=body), seen)  # type: ignore[arg-type]
            finally:
                unpause(client)

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
def test_admin_endpoints_refuse_missing_and_wrong_tokens(stack: BadInputStack, method: str, path: str) -> None:
    with httpx.Client(base_url=stack.proxy, timeout=30) as client:
        for headers in BAD_AUTH:
            r = client.request(method, path, headers=headers, content=b"{}" if method == "POST" else b"")
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["detail"]["error"] == "unauthorized"
            assert client.get("/health").json()["paused"] is False, f"a refused {path} changed the proxy"
        ok = client.request(method, path, headers={"authorization": f"Bearer {ADMIN}"},
                            content=b"{}" if method == "POST" else b"")
        assert ok.status_code == 200, ok.text
        unpause(client)


def test_engine_refuses_weight_paths_outside_its_weights_dir(stack: BadInputStack, tmp_path: Path) -> None:
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


def test_trainer_skips_and_counts_poison_manifests_and_group_records(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    topics = Topics(groups=unique_topic(1), batches=unique_topic(1), weights=unique_topic(1))
    bad_batches = inject_poison(kafka_bootstrap, topics.batches, "batch", "train.batches")
    # rollout.groups is read by reference: one good group, one garbage record a manifest points at.
    good = send(kafka_bootstrap, topics.groups, valid_group("g-good"))
    inject(kafka_bootstrap, topics.groups, [b"\xc1 garbage group"], key=b"g-bad")
    INJECTED["rollout.groups"] += 1
    bad_ref = GroupRef(group_id="g-bad", partition=0, offset=good.offset + 1)
    send(kafka_bootstrap, topics.batches,
         valid_manifest(0, [GroupRef(group_id="g-good", partition=0, offset=good.offset), bad_ref]))
    with service("trainer", "services.trainer", kafka_bootstrap, {
        "REIN_TOPICS__GROUPS": topics.groups,
        "REIN_TOPICS__BATCHES": topics.batches,
        "REIN_TOPICS__WEIGHTS": topics.weights,
        "REIN_WEIGHTS_DIR": str(tmp_path / "weights"),
        "REIN_RUN_DIR": str(tmp_path / "run"),
        "REIN_CONSUMER_GROUP": unique_group,
        "REIN_TORCH_THREADS": "1",
        "REIN_FETCH_TIMEOUT_S": "20",
    }, tmp_path / "logs") as (proc, url):
        metrics_url = f"{url}/metrics"
        lines_path = tmp_path / "run" / "metrics.jsonl"
        wait_until(lambda: lines_path.exists() and lines_path.read_text().strip(), 60, "step 1 (manifest 0)", proc)
        want = expected_reasons(bad_batches)
        wait_until(lambda: decode_errors(metrics_url, topics.batches) == want, 30, f"decode errors {want}", proc)
        line = json.loads(lines_path.read_text().splitlines()[0])
        assert (line["manifest_index"], line["bad_group_refs"]) == (0, 1), line
        assert scrape(metrics_url)[("rein_trainer_bad_group_refs_total", ())] == 1
        # A manifest whose every reference is unusable must not kill the trainer either.
        send(kafka_bootstrap, topics.batches, valid_manifest(1, [bad_ref]))
        wait_until(lambda: scrape(metrics_url)[("rein_trainer_bad_group_refs_total", ())] == 2, 30,
                   "manifest 1 (only unusable refs) handled", proc)
        assert proc.alive(), proc.tail()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    print(f"\ntrainer: injected {len(bad_batches)} on train.batches + 1 on rollout.groups; skipped and counted")


def test_broadcaster_skips_and_counts_poison_weight_records(
    stack: BadInputStack, unique_topic: Callable[..., str], unique_group: str, redis_db_url: str, tmp_path: Path
) -> None:
    weights_topic = unique_topic(1)
    bad = inject_poison(stack.bootstrap, weights_topic, "weight_published", "weights")
    path, digest = stack.checkpoint("v-after-poison", seed=11)
    event = WeightPublished(version="v-after-poison", seq=1, path=str(path), digest=digest, step=1)
    send(stack.bootstrap, weights_topic, event)
    kafka = KafkaSettings(bootstrap_servers=stack.bootstrap)
    with service("broadcaster", "services.weight_broadcaster", stack.bootstrap, {
        "REIN_REDIS__URL": redis_db_url,
        "REIN_REDIS__KEY_PREFIX": f"fault-{uuid.uuid4().hex[:6]}",
        "REIN_TOPICS__WEIGHTS": weights_topic,
        "REIN_PROXY_URLS": json.dumps([stack.proxy]),
        "REIN_ENGINE_URLS": json.dumps([stack.engine]),
        "REIN_ADMIN_TOKEN": ADMIN,
        "REIN_CONSUMER_GROUP": unique_group,
    }, tmp_path / "logs") as (proc, url):
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
    stack: BadInputStack, unique_topic: Callable[..., str], unique_group: str, redis_db_url: str, tmp_path: Path
) -> None:
    retries = unique_topic()
    bad = inject_poison(stack.bootstrap, retries, "retry", "rollout.retries")
    payload = {"task": "guess_number", "secret": 3, "low": 0, "high": 15, "max_turns": 2}
    retry = RetryRequest(prompt_id=f"gn-fault-{uuid.uuid4().hex[:6]}", attempt=1, previous_group_id="g-old",
                         prompt=payload)
    send(stack.bootstrap, retries, retry)
    kafka = KafkaSettings(bootstrap_servers=stack.bootstrap)
    with service("rollout runner", "services.rollout", stack.bootstrap, {
        "REIN_PROXY_URL": stack.proxy,
        "REIN_RUNNER_TOKEN": stack.proxy_proc.runner_token,
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
    }, tmp_path / "logs", start_timeout_s=90, stop_timeout_s=60) as (proc, url):
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
def test_edge_inputs_are_documented_answers(stack: BadInputStack, name: str) -> None:
    path, headers, body = EDGE_CALLS[name]
    with stack.runner() as client:
        if path.endswith("/finish"):  # a real session to finish, so the body is what decides
            _open_session(client, path.split("/")[3])
        r = client.post(path, headers=headers, content=body)  # type: ignore[arg-type]
        print(f"\n{name}: {r.status_code} {r.text[:160]}")
        check_answer(r, Counter())
        assert stack.healthy()


def _open_session(client: httpx.Client, sid: str) -> None:
    """One generation in a trainable session (it has a group id), so a finish would be published."""
    r = client.post("/v1/chat/completions", headers={"x-session-id": sid, "x-group-id": f"grp-{sid}"},
                    content=b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("reward", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_reward_is_refused_not_published(stack: BadInputStack, reward: bytes) -> None:
    """A NaN / infinite reward would reach GRPO's advantages through rollout.events and poison the update."""
    sid = f"edge-reward-{uuid.uuid4().hex[:6]}"
    with stack.runner() as client:
        _open_session(client, sid)
        r = client.post(f"/v1/sessions/{sid}/finish", content=b'{"reward": ' + reward + b"}")
        assert r.status_code == 422, f"reward {reward!r} accepted: {r.status_code} {r.text}"
        ok = client.post(f"/v1/sessions/{sid}/finish", content=b'{"reward": 0.5}')
        assert ok.status_code == 200 and ok.json()["published"] is True, ok.text
