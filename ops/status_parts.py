"""The parts of ``rein status``, each read on its own: Redis (window, registry), Kafka (lag), proxies, engines.

A part either returns its piece of the report or raises; :func:`ops.status.collect` runs
each in its own thread under one deadline and turns a raise or an overrun into
``{"error": "..."}``. Nothing here writes: the registry index of a label is computed from
the sorted sets directly (the registry's ``observe`` would register an unknown label), and
the window and registry are read through :class:`shared.window_layout.WindowReader`, the
layout the collector's window store writes with.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, cast

from shared.names import RedisKeys, Topics
from shared.settings import KafkaSettings, RedisSettings
from shared.version_window import cutoff_index
from shared.versions import VersionRegistry
from shared.window_layout import WindowReader

REJECTIONS_METRIC = "rein_proxy_rejections_total"
NEW_SEGMENTS_METRIC = "rein_proxy_new_segments_total"


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


def _by_label(text: str, metric: str, label: str) -> dict[str, float]:
    """``label value -> count`` of one counter in a ``/metrics`` text, summed over its other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric:
                value = sample.labels.get(label, "")
                out[value] = out.get(value, 0.0) + sample.value
    return out


def parse_rejections(text: str) -> dict[str, float]:
    """``error -> count`` from a proxy's ``/metrics`` text (soft and hard rejections summed)."""
    return _by_label(text, REJECTIONS_METRIC, "error")


def parse_new_segments(text: str) -> dict[str, float]:
    """``reason -> count`` of the segments a proxy started (every reason but ``first`` re-tokenized a history)."""
    return _by_label(text, NEW_SEGMENTS_METRIC, "reason")


# --------------------------------------------------------------------------- parts


def read_window(client: Any, keys: RedisKeys) -> dict[str, Any]:
    """Registry and window from Redis, through the layout the collector writes (read only)."""
    reader = WindowReader(client, keys)
    pairs, registry = reader.registry()
    window = reader.window()
    tally = window.tokens
    config = reader.config()
    keep = config.get("keep_versions")
    keep = keep if isinstance(keep, int) else None
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
            "no_signal_groups": config.get("no_signal_groups"),
            "stale_groups": config.get("stale_groups"),
            "no_signal_run": window.no_signal_run,
            "pending_groups": reader.pending_count(),
            "batches": window.batches,
            "steps": window.steps,
            "outbox": reader.outbox_size(),
        },
        "drops": {
            "total": window.drops_total,
            "by_reason": window.drops_by_reason,
            "since_last_batch": len(window.dropped_since),
            "prompts_dropped_after_retries": window.drops_by_reason.get("failed_dropped", 0),
        },
        "untrained_tokens": {
            "generated": tally.generated,
            "total": tally.untrained,
            "by_cause": tally.by_cause(),
            "share": round(tally.untrained / tally.generated, 4) if tally.generated else None,
        },
    }


def redis_part(settings: RedisSettings, timeout_s: float) -> dict[str, Any]:
    from shared.membership import Members
    from shared.state import client_for

    client = client_for(settings, socket_timeout_s=timeout_s)
    try:
        keys = RedisKeys(settings.key_prefix)
        report = read_window(client, keys)
        report["registered_proxies"] = Members(client, keys, "proxy").live(forget=False)
        report["registered_engines"] = Members(client, keys, "engine").live(forget=False)
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

    from shared.bus import new_client

    servers = [s.strip() for s in settings.bootstrap_servers.split(",") if s.strip()]
    timeout_ms = max(1000, int(timeout_s * 1000))
    common: dict[str, Any] = {
        "bootstrap_servers": servers,
        "request_timeout_ms": timeout_ms,
        "api_version_auto_timeout_ms": timeout_ms,
        "reconnect_backoff_max_ms": 1000,
    }
    try:
        admin = new_client(lambda: KafkaAdminClient(client_id=f"{settings.client_id}-status", **common))
    except NoBrokersAvailable:
        raise NoBrokersAvailable(f"no Kafka broker answered at {settings.bootstrap_servers}") from None
    consumer = None
    try:
        consumer = new_client(lambda: KafkaConsumer(
            client_id=f"{settings.client_id}-status", group_id=None, enable_auto_commit=False, **common
        ))
        out: dict[str, Any] = {}
        for group, fields in groups.items():
            try:
                out[group] = _group_lag(admin, consumer, group, [getattr(topics, f, f) for f in fields], TopicPartition)
            except Exception as exc:  # one group's failure is reported in its row
                out[group] = {"error": describe(exc)}
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
        report["state"] = f"unknown ({describe(exc)})"
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
        out["error"] = describe(exc)
        return out
    try:
        text = http_text(f"{base}/metrics", timeout_s)
    except Exception as exc:
        out["metrics_error"] = describe(exc)  # no rejections, no new segments
        return out
    out["rejections"] = parse_rejections(text)
    out["new_segments"] = parse_new_segments(text)
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


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
