"""The proxy's Prometheus series, on a registry owned by one app instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from shared import metrics

PAUSE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Seconds, for both pause histograms: a pause's wait for quiescence and the time admission stays closed."""


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = metrics.counter(
            registry, "proxy/requests", "HTTP requests answered, by route and status", ("route", "status")
        )
        self.chunks = metrics.counter(registry, "proxy/chunks_published", "Chunk records written to Kafka")
        self.new_segments = metrics.counter(
            registry, "proxy/new_segments",
            "Segments started, by reason: first (a session's first), else why the call could not extend the "
            "last segment token-exact and re-tokenized its whole history", ("reason",),
        )
        self.kept_rewrites = metrics.counter(
            registry, "proxy/kept_rewritten_history",
            "Calls whose chat template rewrote the session's earlier turns (Qwen3 drops earlier thinking) that kept "
            "the segment (REIN_REWRITTEN_HISTORY=keep): the engine saw its own ids; with follow they are "
            "new_segments{reason=template_mismatch}",
        )
        self.tool_call_replies = metrics.counter(
            registry, "proxy/tool_call_replies",
            "Replies with tool-call markup: calls (parsed into tool_calls), malformed (answered as content) or "
            "empty (an empty list of calls: the model's own \"no call\", answered as the text around it)",
            ("outcome",),
        )
        self.takeovers = metrics.counter(
            registry, "proxy/session_takeovers",
            "Calls for a session another proxy replica held: continued (its snapshot restored here, token-exact), "
            "interrupted (that replica stopped during one of its calls: refused), ended (it ended there: refused), "
            "unreadable (refused)", ("outcome",),
        )
        self.moved = metrics.counter(
            registry, "proxy/sessions_moved",
            "Sessions held here that another replica took over meanwhile: their next call here was refused",
        )
        self.handoff_errors = metrics.counter(
            registry, "proxy/session_store_errors",
            "Redis operations on the sessions' handoff state that failed, by operation (begin, save, take, end)",
            ("op",),
        )
        self.tokens = metrics.counter(registry, "proxy/generated_tokens", "Output tokens received from engines")
        self.preempts = metrics.counter(registry, "proxy/preempts", "Engine requests that ended aborted (preempted)")
        self.rejections = metrics.counter(
            registry, "proxy/rejections", "Sessions rejected, by error name", ("error", "soft")
        )
        self.publish_failures = metrics.counter(
            registry, "proxy/publish_failures", "Records that could not be written to Kafka", ("record",)
        )
        self.inflight_bytes = metrics.gauge(
            registry, "proxy/publish_inflight_bytes", "Encoded bytes submitted to Kafka and not yet acked or failed"
        )
        self.inflight_records = metrics.gauge(
            registry, "proxy/publish_inflight_records", "Records submitted to Kafka and not yet acked or failed"
        )
        self.paused = metrics.gauge(registry, "proxy/paused", "1 while the proxy is paused")
        self.lease_expiries = metrics.counter(
            registry, "proxy/pause_lease_expired", "Pauses that ended by themselves (no renew or resume in the lease)"
        )
        self.held = metrics.gauge(registry, "proxy/held_generations", "Preempted generations waiting for resume")
        self.active = metrics.gauge(registry, "proxy/active_engine_requests", "Engine requests in flight")
        self.sessions = metrics.gauge(registry, "proxy/live_sessions", "Sessions neither finished nor rejected")
        self.pause_seconds = Histogram(
            metrics.prom_name("proxy/pause_wait_seconds"), "Time a pause waited for quiescence",
            buckets=PAUSE_BUCKETS, registry=registry,
        )
        self.pause_closed_seconds = Histogram(
            metrics.prom_name("proxy/pause_closed_seconds"),
            "Time admission stayed closed per pause: from the pause request to the resume",
            buckets=PAUSE_BUCKETS, registry=registry,
        )
        self.engine_seconds = Histogram(
            metrics.prom_name("proxy/engine_call_seconds"), "Duration of one engine /generate call",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )
