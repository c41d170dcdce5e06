"""What ``rein status`` reports: the window and registry in Redis, consumer lag, proxies, engines.

Every part is read independently with bounded timeouts and runs in its own daemon
thread under one deadline, so an unreachable broker, Redis, proxy or engine becomes
``{"error": "..."}`` in its part of the report, never a crash or a hang. Nothing here
writes: the registry index of a label is computed from the sorted sets directly (the
registry's ``observe`` would register an unknown label).

The window and registry are read through :class:`shared.window_layout.WindowReader`, the
layout the collector's window store writes with.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pydantic import Field

from shared.names import RedisKeys, Topics
from shared.settings import KafkaSettings, RedisSettings, ServiceSettings
from shared.staleness import cutoff_index
from shared.versions import VersionRegistry
from shared.window_layout import WindowReader

DEFAULT_GROUPS: dict[str, tuple[str, ...]] = {
    "rein-collector": ("chunks", "events"),
    "rein-trainer": ("batches",),
    "rein-weight-broadcaster": ("weights",),
    "rein-rollout": ("retries",),
}
"""Each service's default consumer group and the topics (``Topics`` fields) it consumes."""

REJECTIONS_METRIC = "rein_proxy_rejections_total"


class StatusSettings(ServiceSettings):
    """``rein status`` defaults from the environment (same variable names as the services')."""

    admin_token: str = ""
    """Bearer token of the proxies' admin endpoints (``REIN_ADMIN_TOKEN``)."""
    proxy_urls: list[str] = Field(default_factory=list)
    """Proxies to ask for their pause state (``REIN_PROXY_URLS``, a JSON list)."""
    engine_urls: list[str] = Field(default_factory=list)
    """Engines to ask for their loaded version (``REIN_ENGINE_URLS``, a JSON list)."""


@dataclass
class Targets:
    """Where to look. ``None`` for Kafka or Redis leaves that part out."""

    kafka: KafkaSettings | None
    redis: RedisSettings | None
    topics: Topics = field(default_factory=Topics)
    groups: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_GROUPS))
    proxies: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    services: dict[str, str] = field(default_factory=dict)
    """name -> base URL whose ``/health`` is checked (from a run directory)."""
    admin_token: str = ""
    timeout_s: float = 5.0


class RunDirError(ValueError):
    """A run directory without a readable ``stack.json``."""


@dataclass(frozen=True)
class RunDir:
    """What a ``rein up`` / ``make demo`` run directory says about the running stack."""

    kafka_bootstrap: str
    redis_url: str
    urls: dict[str, str]
    admin_token: str

    @property
    def proxies(self) -> list[str]:
        return [u for name, u in sorted(self.urls.items()) if name == "proxy" or name.startswith("proxy-")]

    @property
    def engines(self) -> list[str]:
        return [u for name, u in sorted(self.urls.items()) if name == "engine" or name.startswith("engine-")]


def read_run_dir(path: Path) -> RunDir:
    stack = path / "stack.json"
    try:
        obj = json.loads(stack.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"cannot read {stack}: {exc}") from None
    infra = obj.get("infra") or {}
    return RunDir(
        kafka_bootstrap=str(infra.get("kafka_bootstrap", "")),
        redis_url=str(infra.get("redis_url", "")),
        urls={str(k): str(v) for k, v in (obj.get("urls") or {}).items()},
        admin_token=str(obj.get("admin_token") or ""),
    )


# --------------------------------------------------------------------------- pure helpers


def _index(registry: VersionRegistry, label: str) -> int | None:
    try:
        return registry.index(label)
    except KeyError:
        return None


def label_index(label: str, published: Sequence[str], unregistered: Sequence[str]) -> int | None:
    """The registry index of ``label`` (the order of :class:`shared.versions.VersionRegistry`), None if unknown."""
    registry = VersionRegistry()
    for seq, name in enumerate(published):
        registry.publish(name, seq)
    for name in unregistered:
        registry.observe(name)
    return _index(registry, label)


def lag_report(
    committed: Mapping[tuple[str, int], int],
    end: Mapping[tuple[str, int], int],
    beginning: Mapping[tuple[str, int], int] | None = None,
) -> dict[str, Any]:
    """Per-partition lag (end offset - committed offset) of one group and its total.

    A partition of the group's topics without a commit lags by everything retained there
    (end - beginning) and is listed with ``committed: null``.
    """
    beginning = beginning or {}
    partitions = []
    total = 0
    for tp in sorted(set(committed) | set(end)):
        topic, partition = tp
        end_offset = end.get(tp)
        done = committed.get(tp)
        if end_offset is None:
            lag = None
        elif done is None:
            lag = max(0, end_offset - beginning.get(tp, 0))
        else:
            lag = max(0, end_offset - done)
        if lag is not None:
            total += lag
        partitions.append(
            {"topic": topic, "partition": partition, "committed": done, "end": end_offset, "lag": lag}
        )
    return {"lag": total, "partitions": partitions}


def parse_rejections(text: str) -> dict[str, float]:
    """``error -> count`` from a proxy's ``/metrics`` text (soft and hard rejections summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REJECTIONS_METRIC:
                error = sample.labels.get("error", "")
                out[error] = out.get(error, 0.0) + sample.value
    return out


# --------------------------------------------------------------------------- parts


def read_window(client: Any, keys: RedisKeys) -> dict[str, Any]:
    """Registry and window from Redis, through the layout the collector writes (read only)."""
    reader = WindowReader(client, keys)
    pairs, registry = reader.registry()
    window = reader.window()
    config = reader.config()
    keep = config.get("keep_versions")
    current = window.current
    current_index = None if current is None else _index(registry, current)
    cutoff = None if keep is None else cutoff_index(current_index, keep)
    ordered = [label for label, _ in pairs] + registry.unregistered
    cutoff_label = ordered[cutoff] if cutoff is not None and cutoff < len(ordered) else None
    return {
        "registry": {
            "published": [{"label": label, "seq": seq, "index": i} for i, (label, seq) in enumerate(pairs)],
            "unregistered": [{"label": label, "index": registry.index(label)} for label in registry.unregistered],
        },
        "window": {
            "current_version": current,
            "current_index": current_index,
            "cutoff_index": cutoff,
            "cutoff_version": cutoff_label,
            "keep_versions": keep,
            "batch_groups": config.get("batch_groups"),
            "max_retries": config.get("max_retries"),
            "pending_groups": reader.pending_count(),
            "batches": window.batches,
            "steps": window.steps,
            "outbox": reader.outbox_size(),
        },
        "drops": {
            "total": window.drops_total,
            "by_reason": window.drops_by_reason,
            "since_last_batch": len(window.dropped_since),
            "prompts_dropped_after_retries": len(reader.prompt_drops()),
        },
    }


def redis_part(settings: RedisSettings, timeout_s: float) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(
        settings.url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        decode_responses=True,
    )
    try:
        report = read_window(client, RedisKeys(settings.key_prefix))
    finally:
        client.close()
    report["url"] = settings.url
    report["key_prefix"] = settings.key_prefix
    return report


def kafka_part(
    settings: KafkaSettings, topics: Topics, groups: Mapping[str, Sequence[str]], timeout_s: float
) -> dict[str, Any]:
    """Lag of every group, its state and member count (one admin client, one offsets consumer)."""
    from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
    from kafka.errors import NoBrokersAvailable

    servers = [s.strip() for s in settings.bootstrap_servers.split(",") if s.strip()]
    timeout_ms = max(1000, int(timeout_s * 1000))
    common: dict[str, Any] = {
        "bootstrap_servers": servers,
        "request_timeout_ms": timeout_ms,
        "api_version_auto_timeout_ms": timeout_ms,
        "reconnect_backoff_max_ms": 1000,
    }
    try:
        admin = KafkaAdminClient(client_id=f"{settings.client_id}-status", **common)
    except NoBrokersAvailable:
        raise NoBrokersAvailable(f"no Kafka broker answered at {settings.bootstrap_servers}") from None
    consumer = None
    try:
        consumer = KafkaConsumer(
            client_id=f"{settings.client_id}-status", group_id=None, enable_auto_commit=False, **common
        )
        out: dict[str, Any] = {}
        for group, fields in groups.items():
            try:
                out[group] = _group_lag(admin, consumer, group, [getattr(topics, f, f) for f in fields], TopicPartition)
            except Exception as exc:  # one group's failure is reported in its row
                out[group] = {"error": _describe(exc)}
        return {"bootstrap": settings.bootstrap_servers, "groups": out}
    finally:
        if consumer is not None:
            consumer.close()
        admin.close()


def _group_lag(admin: Any, consumer: Any, group: str, topics: list[str], tp_type: Any) -> dict[str, Any]:
    raw = admin.list_consumer_group_offsets(group)
    committed = {(tp.topic, tp.partition): int(meta.offset) for tp, meta in raw.items() if meta.offset >= 0}
    wanted = set(committed)
    for topic in topics:
        for partition in consumer.partitions_for_topic(topic) or ():
            wanted.add((topic, partition))
    tps = [tp_type(t, p) for t, p in sorted(wanted)]
    end = {(tp.topic, tp.partition): int(o) for tp, o in consumer.end_offsets(tps).items()} if tps else {}
    missing = [tp for tp in tps if (tp.topic, tp.partition) not in committed]
    begin = (
        {(tp.topic, tp.partition): int(o) for tp, o in consumer.beginning_offsets(missing).items()} if missing else {}
    )
    report = lag_report(committed, end, begin)
    report["committed"] = bool(committed)
    try:
        info = admin.describe_consumer_groups([group])[0]
        report["state"] = str(info.state)
        report["members"] = len(info.members)
    except Exception as exc:  # state is a nicety; lag is what matters
        report["state"] = f"unknown ({_describe(exc)})"
    return report


def http_json(url: str, timeout_s: float, token: str = "") -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read().decode("utf-8"))


def http_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return cast(bytes, response.read()).decode("utf-8")


def proxy_part(url: str, token: str, timeout_s: float) -> dict[str, Any]:
    base = url.rstrip("/")
    out: dict[str, Any] = {"url": url}
    try:
        state = http_json(f"{base}/v1/rollout/state", timeout_s, token)
        out.update(
            {
                k: state.get(k)
                for k in ("paused", "reason", "pause_id", "lease_left_s", "pauses", "active", "held",
                          "live_sessions", "partial_rollout", "max_preempts", "engines")
            }
        )
    except urllib.error.HTTPError as exc:
        hint = " (admin token missing or wrong: --admin-token)" if exc.code in (401, 403) else ""
        out["error"] = f"GET /v1/rollout/state: HTTP {exc.code}{hint}"
        with contextlib.suppress(Exception):  # /health needs no token and still says whether it is paused
            out["paused"] = http_json(f"{base}/health", timeout_s).get("paused")
    except Exception as exc:
        out["error"] = _describe(exc)
        return out
    try:
        out["rejections"] = parse_rejections(http_text(f"{base}/metrics", timeout_s))
    except Exception as exc:
        out["rejections_error"] = _describe(exc)
    return out


def engine_part(url: str, timeout_s: float) -> dict[str, Any]:
    info = http_json(f"{url.rstrip('/')}/get_model_info", timeout_s)
    return {
        "url": url,
        "weight_version": info.get("weight_version"),
        "model_path": info.get("model_path"),
        "active_requests": info.get("active_requests"),
    }


def health_part(url: str, timeout_s: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as response:
            return {"url": url, "ok": 200 <= response.status < 300}
    except urllib.error.HTTPError as exc:
        return {"url": url, "ok": False, "error": f"HTTP {exc.code}"}


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


# --------------------------------------------------------------------------- gathering


def _run_parts(parts: dict[str, Callable[[], Any]], deadline_s: float) -> dict[str, Any]:
    """Run every part in a daemon thread; a part that raises or overruns the deadline gives an error."""
    results: dict[str, Any] = {}
    lock = threading.Lock()

    def work(name: str, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except Exception as exc:
            value = {"error": _describe(exc)}
        with lock:
            results[name] = value

    threads = {name: threading.Thread(target=work, args=(name, fn), daemon=True) for name, fn in parts.items()}
    for thread in threads.values():
        thread.start()
    end = time.monotonic() + deadline_s
    for thread in threads.values():
        thread.join(max(0.0, end - time.monotonic()))
    with lock:
        out = dict(results)
    for name in parts:
        out.setdefault(name, {"error": f"no answer within {deadline_s:.0f}s"})
    return out


def collect(targets: Targets) -> dict[str, Any]:
    """The whole report as plain data (what ``rein status --json`` prints)."""
    t = targets.timeout_s
    parts: dict[str, Callable[[], Any]] = {}
    redis_settings, kafka_settings = targets.redis, targets.kafka
    if redis_settings is not None:
        parts["redis"] = lambda: redis_part(redis_settings, t)
    if kafka_settings is not None:
        parts["kafka"] = lambda: kafka_part(kafka_settings, targets.topics, targets.groups, t)
    for i, url in enumerate(targets.proxies):
        parts[f"proxy:{i}"] = lambda url=url: proxy_part(url, targets.admin_token, t)  # type: ignore[misc]
    for i, url in enumerate(targets.engines):
        parts[f"engine:{i}"] = lambda url=url: engine_part(url, t)  # type: ignore[misc]
    for name, url in targets.services.items():
        parts[f"service:{name}"] = lambda url=url: health_part(url, t)  # type: ignore[misc]
    # Kafka clients may spend a few request timeouts on bootstrap + offsets: allow for that, bounded.
    got = _run_parts(parts, deadline_s=4 * t + 2)
    report: dict[str, Any] = {"time": time.time()}
    redis_report = got.get("redis")
    if redis_report is None:
        report["redis"] = {"error": "not queried (no Redis given)"}
    elif "error" in redis_report:
        report["redis"] = redis_report
    else:
        report["redis"] = {"url": redis_report.pop("url"), "key_prefix": redis_report.pop("key_prefix")}
        report.update(redis_report)  # registry, window, drops
    report["consumer_groups"] = got.get("kafka", {"error": "not queried (no Kafka given)"})
    for key, label in (("proxy", "proxies"), ("engine", "engines")):
        urls = targets.proxies if key == "proxy" else targets.engines
        rows = []
        for i, url in enumerate(urls):
            row = got[f"{key}:{i}"]
            rows.append(row if "url" in row else {"url": url, **row})
        report[label] = rows
    report["rejections"] = _total_rejections(report["proxies"])
    report["services"] = {
        name: (row if "url" in row else {"url": targets.services[name], "ok": False, **row})
        for name in targets.services
        for row in [got[f"service:{name}"]]
    }
    report["ok"] = _all_ok(report)
    return report


def _total_rejections(proxies: list[dict[str, Any]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for row in proxies:
        for error, n in (row.get("rejections") or {}).items():
            total[error] = total.get(error, 0.0) + n
    return total


def _all_ok(report: dict[str, Any]) -> bool:
    if "error" in report["redis"] or "error" in report["consumer_groups"]:
        return False
    if any("error" in g for g in report["consumer_groups"].get("groups", {}).values()):
        return False
    if any("error" in row for row in report["proxies"] + report["engines"]):
        return False
    return all(row.get("ok") for row in report["services"].values())
