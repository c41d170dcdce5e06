"""A broadcaster wired to fakes for its unit tests: ``FakeClient`` plays every proxy and engine (and logs
each call, in order), ``FakeRegistry`` the version registry, ``FakeProducer`` the topic it announces on;
``make`` builds one with two proxies and two engines, ``ev`` a published version."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from services.weight_broadcaster.clients import EngineAnswer
from services.weight_broadcaster.decide import PauseAnswer
from services.weight_broadcaster.loop import Broadcaster
from services.weight_broadcaster.metrics import BroadcasterMetrics
from services.weight_broadcaster.settings import BroadcasterSettings
from shared.schemas import WeightApplied, WeightPublished
from shared.settings import load


@dataclass
class FakeClient:
    quiesce: list[bool]
    """Answer of each pause round (every proxy answers alike)."""
    digest: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, ...]] = field(default_factory=list)
    engine_version: dict[str, str] = field(default_factory=dict)
    renew_errors: list[str] = field(default_factory=list)
    """Answer of each renew call in order (then ""): a non-empty one says the proxy lost the pause."""
    pause_ids: list[str] = field(default_factory=list)
    info_reads: list[tuple[str, int]] = field(default_factory=list)
    """``(engine, number of calls logged before)`` of each model_info read."""
    report_digest: bool = True
    """False: engines report no digest (SGLang)."""
    ignore_version: bool = False
    """True: updates succeed but keep the old label (an engine ignoring ``weight_version``)."""
    update_says_served: bool = False
    """True: the update's answer says what the engine serves now (rein's engine)."""
    stages: bool = False
    """True: engines take ``/stage_weights`` (rein's; the calls are logged); False: 404, as SGLang."""
    stage_asks: list[str] = field(default_factory=list)
    """Every engine asked to stage, logged or not."""
    down: set[str] = field(default_factory=set)
    """Engines that do not answer (their calls fail)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _log(self, *call: str) -> None:
        with self._lock:
            self.calls.append(call)

    def pause(self, proxy: str, reason: str, timeout_s: float, pause_id: str, lease_s: float) -> PauseAnswer:
        self._log("pause", proxy)
        with self._lock:
            self.pause_ids.append(pause_id)
        rounds = sum(1 for c in self.calls if c == ("pause", proxy))
        return PauseAnswer(proxy, ok=True, quiesced=self.quiesce[min(rounds, len(self.quiesce)) - 1])

    def renew(self, proxy: str, pause_id: str, lease_s: float) -> str:
        self._log("renew", proxy)
        with self._lock:
            assert pause_id == self.pause_ids[-1], "renews name the current pause"
            return self.renew_errors.pop(0) if self.renew_errors else ""

    def resume(self, proxy: str, version: str | None, pause_id: str | None = None) -> str:
        self._log("resume", proxy, str(version))
        return ""

    def update(self, engine: str, model_path: str, version: str, timeout_s: float, abort_all: bool) -> EngineAnswer:
        self._log("update", engine, version)
        if engine in self.down:
            return EngineAnswer(engine, ok=False, error="ConnectError: refused")
        if not self.ignore_version:
            self.engine_version[engine] = version
        if not self.update_says_served:
            return EngineAnswer(engine, ok=True)
        served = self.engine_version.get(engine, "v0")
        return EngineAnswer(engine, ok=True, weight_version=served,
                            digest=self.digest.get(f"/w/{served}.pt", "d-initial"), served=True, staged=self.stages)

    def stage(self, engine: str, model_path: str, timeout_s: float) -> str | None:
        with self._lock:
            self.stage_asks.append(engine)
        if not self.stages:
            return None
        self._log("stage", engine, model_path)
        return ""

    def model_info(self, engine: str) -> EngineAnswer:
        with self._lock:
            self.info_reads.append((engine, len(self.calls)))
        if engine in self.down:
            return EngineAnswer(engine, ok=False, error="ConnectError: refused")
        version = self.engine_version.get(engine, "v0")
        digest = self.digest.get(f"/w/{version}.pt", "d-initial") if self.report_digest else None
        return EngineAnswer(engine, ok=True, weight_version=version, digest=digest)


class FakeRegistry:
    def __init__(self) -> None:
        self.seq_of: dict[str, int] = {}
        self.published: list[tuple[str, int]] = []

    def publish(self, label: str, seq: int) -> bool:
        known = self.seq_of.get(label)
        if known is not None and known != seq:
            raise ValueError(f"version {label} already published with sequence {known}")
        self.seq_of[label] = seq
        self.published.append((label, seq))
        return known is None

    def seqs(self, labels: list[str]) -> list[int | None]:
        return [self.seq_of.get(label) for label in labels]


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[WeightApplied] = []

    def send(self, topic: str, record: WeightApplied, key: str | None = None) -> Any:
        self.sent.append(record)


def ev(seq: int) -> WeightPublished:
    return WeightPublished(version=f"v{seq}", seq=seq, path=f"/w/v{seq}.pt", digest=f"d{seq}", step=seq)


def make(quiesce: list[bool], **overrides: Any) -> tuple[Broadcaster, FakeClient, FakeRegistry, FakeProducer]:
    values = {"admin_token": "t" * 16, "proxy_urls": ["http://p1", "http://p2"], "engine_urls": ["http://e1", "http://e2"],
              "backoff_base_s": 0.0, "backoff_max_s": 0.0, **overrides}
    settings = load(BroadcasterSettings, **values)
    client = FakeClient(quiesce=quiesce, digest={f"/w/v{i}.pt": f"d{i}" for i in range(10)})
    registry, producer = FakeRegistry(), FakeProducer()
    b = Broadcaster(settings, client, registry, producer, BroadcasterMetrics(CollectorRegistry()),  # type: ignore[arg-type]
                    threading.Event())
    return b, client, registry, producer


def _value(b: Broadcaster, name: str, **labels: str) -> float:
    v = b.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v
