"""Pure parts of ``rein status`` and its HTTP parts against a stand-in proxy / engine (no Kafka, no Redis)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ops.cli import build_parser
from ops.commands.status import targets_from_args
from ops.status import StatusSettings, Targets, collect, read_run_dir
from ops.status_parts import (
    engine_part,
    label_index,
    lag_report,
    parse_new_segments,
    parse_rejections,
    proxy_part,
    read_window,
)
from ops.status_render import render
from shared.names import RedisKeys

TOKEN = "secret-token"
METRICS = """\
# HELP rein_proxy_rejections_total Sessions rejected, by error name
# TYPE rein_proxy_rejections_total counter
rein_proxy_rejections_total{error="partial_rollout_staleness_exceeded",soft="false"} 3.0
rein_proxy_rejections_total{error="partial_rollout_staleness_exceeded",soft="true"} 1.0
rein_proxy_rejections_total{error="generation_preempted",soft="false"} 2.0
# HELP rein_proxy_new_segments_total Segments started, by reason
# TYPE rein_proxy_new_segments_total counter
rein_proxy_new_segments_total{reason="first"} 12.0
rein_proxy_new_segments_total{reason="assistant_dropped"} 30.0
rein_proxy_new_segments_total{reason="history_diverged"} 2.0
# HELP rein_proxy_paused 1 while the proxy is paused
# TYPE rein_proxy_paused gauge
rein_proxy_paused 1.0
"""


def test_label_index_published_then_unregistered() -> None:
    published, unregistered = ["v0", "v1"], ["rogue", "x"]
    assert [label_index(v, published, unregistered) for v in ("v0", "v1", "rogue", "x", "nope")] == [0, 1, 2, 3, None]


def test_lag_report() -> None:
    committed = {("a", 0): 5, ("a", 1): 7}
    end = {("a", 0): 9, ("a", 1): 7, ("b", 0): 4}
    report = lag_report(committed, end, {("b", 0): 1})
    assert report["lag"] == 4 + 0 + 3  # b/0 has no commit: everything retained there
    rows = {(p["topic"], p["partition"]): p for p in report["partitions"]}
    assert rows["a", 0] == {"topic": "a", "partition": 0, "committed": 5, "end": 9, "lag": 4}
    assert rows["b", 0]["committed"] is None
    assert lag_report({}, {})["lag"] == 0


def test_parse_rejections_sums_soft_and_hard() -> None:
    assert parse_rejections(METRICS) == {"partial_rollout_staleness_exceeded": 4.0, "generation_preempted": 2.0}
    assert parse_rejections("") == {}


def test_parse_new_segments_by_reason() -> None:
    assert parse_new_segments(METRICS) == {"first": 12.0, "assistant_dropped": 30.0, "history_diverged": 2.0}
    assert parse_new_segments("") == {}


class FakeRedis:
    """The handful of read calls ``read_window`` makes."""

    def __init__(self, keys: RedisKeys) -> None:
        self.zsets = {keys.registry_order: [("v0", 0.0), ("v1", 1.0), ("v2", 2.0)], keys.unregistered: [("rogue", 1.0)]}
        self.hashes = {
            keys.window: {"current": "v2", "batches": "3", "steps": "9", "drops_total": "5",
                          "drops:dropped_stale": "1", "drops:failed_dropped": "2", "drops:dropped_no_signal": "3",
                          "dropped_since": json.dumps([["g7", "dropped_stale"]]), "no_signal_run": "2",
                          "tokens_generated": "400", "untrained:window": "30", "untrained:no_signal": "60",
                          "untrained:failed": "10"},
            keys.window_config: {"keep_versions": "2", "batch_groups": "4", "max_retries": "2",
                                 "no_signal_groups": "drop"},
        }
        self.lists = {keys.pending_order: ["g8", "g9"], keys.outbox: []}

    def zrange(self, key: str, start: int, end: int, withscores: bool = False) -> list[Any]:
        pairs = self.zsets.get(key, [])
        return list(pairs) if withscores else [label for label, _ in pairs]

    def hgetall(self, key: str) -> dict[str, str]:
        return dict(self.hashes.get(key, {}))

    def llen(self, key: str) -> int:
        return len(self.lists.get(key, []))


def test_read_window() -> None:
    keys = RedisKeys("p")
    report = read_window(FakeRedis(keys), keys)
    assert report["window"] == {
        "current_version": "v2", "current_index": 2, "cutoff_index": 1, "cutoff_version": "v1",
        "keep_versions": 2, "batch_groups": 4, "max_retries": 2, "no_signal_groups": "drop", "stale_groups": None,
        "no_signal_run": 2,
        "pending_groups": 2, "batches": 3, "steps": 9, "outbox": 0,
    }
    assert report["drops"] == {
        "total": 5, "by_reason": {"dropped_stale": 1, "failed_dropped": 2, "dropped_no_signal": 3},
        "since_last_batch": 1, "prompts_dropped_after_retries": 2,
    }
    assert report["untrained_tokens"] == {
        "generated": 400, "total": 100, "by_cause": {"window": 30, "no_signal": 60, "failed": 10, "withheld": 0},
        "share": 0.25,
    }
    assert report["registry"]["unregistered"] == [{"label": "rogue", "index": 3}]
    assert report["registry"]["published"][2] == {"label": "v2", "seq": 2, "index": 2}


def test_read_window_of_an_empty_deployment() -> None:
    keys = RedisKeys("empty")
    fake = FakeRedis(keys)
    fake.zsets, fake.hashes, fake.lists = {}, {}, {}
    report = read_window(fake, keys)
    window = report["window"]
    assert window["current_version"] is None and window["cutoff_index"] is None and window["keep_versions"] is None
    assert report["untrained_tokens"]["generated"] == 0 and report["untrained_tokens"]["share"] is None


def test_render_shows_untrained_tokens_by_cause() -> None:
    keys = RedisKeys("p")
    report = collect(Targets(kafka=None, redis=None))
    report.update(read_window(FakeRedis(keys), keys), redis={"url": "redis://r", "key_prefix": "p"})
    assert "untrained tokens 100 of 400 generated (25.0%): window 30, no_signal 60, failed 10" in render(report)


@pytest.fixture
def fake_services() -> Iterator[str]:
    """One server playing a proxy (token-checked state, /metrics, /health) and an engine (/get_model_info)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/v1/rollout/state":
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._send(401, {"detail": "unauthorized"})
                else:
                    self._send(200, {"paused": True, "reason": "weight_update", "pause_id": "pause-1",
                                     "lease_left_s": 12.5, "pauses": 4, "active": 0, "held": 2,
                                     "live_sessions": 5, "engines": []})
            elif self.path == "/metrics":
                self._send(200, METRICS, "text/plain")
            elif self.path == "/health":
                self._send(200, {"status": "ok", "paused": True})
            elif self.path == "/get_model_info":
                self._send(200, {"weight_version": "v7", "model_path": "/w/v7.pt", "active_requests": 1})
            else:
                self._send(404, {})

        def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_proxy_and_engine_parts(fake_services: str) -> None:
    row = proxy_part(fake_services, TOKEN, 5)
    assert row["paused"] is True and row["reason"] == "weight_update" and row["held"] == 2
    assert (row["pause_id"], row["lease_left_s"]) == ("pause-1", 12.5)
    assert row["rejections"]["partial_rollout_staleness_exceeded"] == 4.0
    assert row["new_segments"] == {"first": 12.0, "assistant_dropped": 30.0, "history_diverged": 2.0}
    no_token = proxy_part(fake_services, "", 5)
    assert "HTTP 401" in no_token["error"] and "--admin-token" in no_token["error"]
    assert no_token["paused"] is True  # from /health
    assert engine_part(fake_services, 5)["weight_version"] == "v7"


def test_collect_and_render_with_http_parts_only(fake_services: str) -> None:
    targets = Targets(kafka=None, redis=None, proxies=[fake_services], engines=[fake_services, "http://127.0.0.1:1"],
                      services={"trainer": fake_services}, admin_token=TOKEN, timeout_s=2)
    report = collect(targets)
    assert report["engines"][0]["weight_version"] == "v7"
    assert "error" in report["engines"][1]
    assert report["rejections"] == {"partial_rollout_staleness_exceeded": 4.0, "generation_preempted": 2.0}
    assert report["new_segments"] == {"first": 12.0, "assistant_dropped": 30.0, "history_diverged": 2.0}
    assert report["services"]["trainer"]["ok"] is True
    assert report["ok"] is False
    json.dumps(report)  # --json must serialise
    text = render(report)
    assert "PAUSED (weight_update)" in text
    assert "version v7" in text
    assert "http://127.0.0.1:1: ERROR" in text
    assert "partial_rollout_staleness_exceeded 4" in text
    assert "new segments (proxies, since start): 44 (12 first; 32 re-tokenized a history: assistant_dropped 30, " \
        "history_diverged 2)" in text


def test_run_dir_fills_in_what_flags_do_not_give(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text(json.dumps({
        "urls": {"engine": "http://e:1", "proxy": "http://p:2", "collector-0": "http://c:3"},
        "infra": {"kafka_bootstrap": "k:9", "redis_url": "redis://r:6/0"},
        "admin_token": "tok",
    }))
    run_dir = read_run_dir(tmp_path)
    assert run_dir.proxies == ["http://p:2"] and run_dir.engines == ["http://e:1"]
    parser = build_parser()
    args = parser.parse_args(["status", "--run-dir", str(tmp_path), "--redis", "redis://other:1/2"])
    targets = targets_from_args(args, StatusSettings())
    assert targets.kafka is not None and targets.kafka.bootstrap_servers == "k:9"
    assert targets.redis is not None and targets.redis.url == "redis://other:1/2"
    assert targets.admin_token == "tok"
    assert targets.proxies == ["http://p:2"] and targets.services == {"collector-0": "http://c:3"}
    assert set(targets.groups) == {"rein-collector", "rein-trainer", "rein-weight-broadcaster", "rein-rollout"}


def test_a_stack_on_shared_infrastructure_is_read_under_its_namespace(tmp_path: Path) -> None:
    """``StackConfig.shared_infra``: the run directory names the namespace of its topics, groups and keys."""
    (tmp_path / "stack.json").write_text(json.dumps({
        "config": {"shared_infra": {"kafka_bootstrap": "k:9", "redis_url": "redis://r:6/0", "namespace": "s.x"}},
        "urls": {}, "infra": {"kafka_bootstrap": "k:9", "redis_url": "redis://r:6/0"}, "admin_token": "tok",
    }))
    args = build_parser().parse_args(["status", "--run-dir", str(tmp_path)])
    targets = targets_from_args(args, StatusSettings())
    assert targets.topics.chunks == "s.x.rollout.chunks" and targets.topics.weights == "s.x.weights"
    assert targets.groups["s.x.rein-collector"] == ("chunks", "events") and len(targets.groups) == 4
    assert targets.redis is not None and targets.redis.key_prefix == "s.x"
    told = targets_from_args(build_parser().parse_args(["status", "--run-dir", str(tmp_path), "--key-prefix", "p"]),
                             StatusSettings())
    assert told.redis is not None and told.redis.key_prefix == "p", "a flag over the run directory"


def test_help_and_missing_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main

    with pytest.raises(SystemExit):
        main(["status", "--help"])
    assert "--run-dir" in capsys.readouterr().out
    assert main(["status", "--run-dir", str(tmp_path / "nope")]) == 2
    assert "stack.json" in capsys.readouterr().err
