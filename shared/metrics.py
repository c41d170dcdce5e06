"""Prometheus metrics shared by several services.

Reports use the reference names (``staleness/version_gap_mean``); Prometheus
forbids ``/`` so the endpoint exposes ``rein_staleness_version_gap_mean``.
:func:`prom_name` is the one mapping between the two. Each service owns a
``CollectorRegistry`` (no process globals) and serves it with :func:`render`.
"""

from __future__ import annotations

import re

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def prom_name(report_name: str, namespace: str = "rein") -> str:
    """``staleness/version_gap_mean`` -> ``rein_staleness_version_gap_mean``."""
    return f"{namespace}_{_UNSAFE.sub('_', report_name)}"


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """Body and content type for a ``/metrics`` response."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def gauge(registry: CollectorRegistry, report_name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    """A gauge registered under the Prometheus-safe form of a report name."""
    return Gauge(prom_name(report_name), doc, labelnames=labels, registry=registry)


def counter(registry: CollectorRegistry, report_name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    """A counter registered under the Prometheus-safe form of a report name."""
    return Counter(prom_name(report_name), doc, labelnames=labels, registry=registry)


class DecodeErrors:
    """Malformed records skipped by a consumer, by topic and reason (never a crash)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = counter(
            registry, "bus/decode_errors", "Records skipped because they could not be decoded", ("topic", "reason")
        )

    def inc(self, topic: str, reason: str) -> None:
        self.counter.labels(topic=topic, reason=reason).inc()
