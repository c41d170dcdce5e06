"""What ``rein status`` reports: the window and registry in Redis, consumer lag, proxies, engines.

Where to look (settings, a run directory) and the gathering. Every part
(:mod:`ops.status_parts`) is read independently with bounded timeouts and runs in its
own daemon thread under one deadline, so an unreachable broker, Redis, proxy or engine
becomes ``{"error": "..."}`` in its part of the report, never a crash or a hang.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from ops.status_parts import describe, engine_part, health_part, kafka_part, proxy_part, redis_part
from shared.names import Topics
from shared.settings import KafkaSettings, RedisSettings, ServiceSettings

DEFAULT_GROUPS: dict[str, tuple[str, ...]] = {
    "rein-collector": ("chunks", "events"),
    "rein-trainer": ("batches",),
    "rein-weight-broadcaster": ("weights",),
    "rein-rollout": ("retries",),
}
"""Each service's default consumer group and the topics (``Topics`` fields) it consumes."""

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
    redis_sentinels: tuple[str, ...] = ()
    """Set when the run's Redis fails over: the primary is whoever they name."""
    namespace: str = ""
    """Set when the stack ran on a shared Kafka and Redis: its topics, consumer groups and Redis keys are under it."""

    @property
    def proxies(self) -> list[str]:
        """Each proxy itself: the replicas when there are several (``proxy`` is then their load balancer)."""
        replicas = [u for name, u in sorted(self.urls.items()) if name.startswith("proxy-")]
        return replicas or [u for name, u in self.urls.items() if name == "proxy"]

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
        redis_sentinels=tuple(str(s) for s in infra.get("redis_sentinels") or ()),
        namespace=str(((obj.get("config") or {}).get("shared_infra") or {}).get("namespace") or ""),
    )


# --------------------------------------------------------------------------- gathering


def redis_target(
    redis: RedisSettings, run_dir: RunDir | None, url: str | None, key_prefix: str | None
) -> RedisSettings:
    """The Redis an operator command reads: ``url`` (a flag) over the run directory's (with its Sentinels)
    over ``redis`` (the environment); ``key_prefix`` when given."""
    url = url or (run_dir.redis_url if run_dir else None)
    if url:
        redis = redis.model_copy(update={"url": url})
    if run_dir and run_dir.redis_sentinels and url == run_dir.redis_url:
        redis = redis.model_copy(update={"sentinels": list(run_dir.redis_sentinels)})
    if key_prefix:
        redis = redis.model_copy(update={"key_prefix": key_prefix})
    return redis


def _run_parts(parts: dict[str, Callable[[], Any]], deadline_s: float) -> dict[str, Any]:
    """Run every part in a daemon thread; a part that raises or overruns the deadline gives an error."""
    results: dict[str, Any] = {}
    lock = threading.Lock()

    def work(name: str, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except Exception as exc:
            value = {"error": describe(exc)}
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
        report.update(redis_report)  # registry, window, drops, untrained_tokens
    report["consumer_groups"] = got.get("kafka", {"error": "not queried (no Kafka given)"})
    for key, label in (("proxy", "proxies"), ("engine", "engines")):
        urls = targets.proxies if key == "proxy" else targets.engines
        rows = []
        for i, url in enumerate(urls):
            row = got[f"{key}:{i}"]
            rows.append(row if "url" in row else {"url": url, **row})
        report[label] = rows
    report["rejections"] = _total(report["proxies"], "rejections")
    report["new_segments"] = _total(report["proxies"], "new_segments")
    report["services"] = {
        name: (row if "url" in row else {"url": targets.services[name], "ok": False, **row})
        for name in targets.services
        for row in [got[f"service:{name}"]]
    }
    report["ok"] = _all_ok(report)
    return report


def _total(proxies: list[dict[str, Any]], key: str) -> dict[str, float]:
    """One ``label -> count`` part of every proxy's row, summed."""
    total: dict[str, float] = {}
    for row in proxies:
        for label, n in (row.get(key) or {}).items():
            total[label] = total.get(label, 0.0) + n
    return total


def _all_ok(report: dict[str, Any]) -> bool:
    if "error" in report["redis"] or "error" in report["consumer_groups"]:
        return False
    if any("error" in g for g in report["consumer_groups"].get("groups", {}).values()):
        return False
    if any("error" in row for row in report["proxies"] + report["engines"]):
        return False
    return all(row.get("ok") for row in report["services"].values())
