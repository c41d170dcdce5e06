"""The weight broadcaster: the control plane's one writer.

Consumes ``weights`` (consumer group ``consumer_group``, manual commit after the
work is done) and reacts to ``WeightPublished``; produces ``WeightApplied`` on the
same topic (key = version). Owns the order of the version registry in Redis
(``RedisRegistry.publish``; nobody else publishes).

Per poll: register every new version in sequence order; of the versions in the
poll only the newest is loaded (older ones are superseded). For that version:
skip it if the engines already serve something newer, re-announce it if they
already serve it (a replay after a crash), else: pause every proxy → if any did
not quiesce, resume all, back off and retry (bounded, then give the version up)
→ load it on every engine and check each reported digest → resume every proxy
(always, in ``finally``; with the version when it was applied) → publish
``WeightApplied``. Offsets are committed once the poll's events are handled, so
a crash replays them and the replay is idempotent.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from services.weight_broadcaster.clients import ControlClient, EngineAnswer
from services.weight_broadcaster.decide import (
    EventAction,
    PauseAction,
    after_pause,
    backoff_s,
    classify,
    digest_mismatches,
    plan_events,
)
from services.weight_broadcaster.settings import BroadcasterSettings
from shared import log, metrics
from shared.bus import Consumer, Polled, Producer
from shared.names import RedisKeys
from shared.schemas import DecodeError, WeightApplied, WeightPublished
from shared.state import RedisRegistry, connect
from shared.status_server import StatusServer

_log = log.get(__name__)


class BroadcasterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.unquiesced = metrics.counter(
            registry, "broadcaster/unquiesced", "Pause answers that failed or did not quiesce (no update followed)",
            ("proxy",))
        self.outcomes = metrics.counter(registry, "broadcaster/versions", "Weight versions handled, by outcome",
                                        ("outcome",))
        self.pause_rounds = metrics.counter(registry, "broadcaster/pause_rounds", "Pause rounds sent to the proxies")
        self.update_failures = metrics.counter(registry, "broadcaster/update_failures",
                                               "Engine update calls that failed or reported a wrong digest",
                                               ("engine",))
        self.resume_failures = metrics.counter(registry, "broadcaster/resume_failures", "Resume calls that failed",
                                               ("proxy",))
        self.applied_seq = metrics.gauge(registry, "broadcaster/applied_seq", "Sequence of the newest applied version")
        self.update_seconds = metrics.gauge(registry, "broadcaster/update_seconds",
                                            "Pause-to-resume time of the last applied version")
        self.decode_errors = metrics.DecodeErrors(registry)


@dataclass
class Outcome:
    version: str
    seq: int
    outcome: str
    """applied | already_applied | older | superseded | unquiesced | update_failed | registry_conflict"""
    unquiesced: list[str] = field(default_factory=list)
    failed_engines: list[str] = field(default_factory=list)


class Broadcaster:
    """Handles weight events; transports are passed in (tests drive :meth:`handle` directly)."""

    def __init__(
        self,
        settings: BroadcasterSettings,
        client: ControlClient,
        registry: RedisRegistry,
        producer: Producer,
        bmetrics: BroadcasterMetrics,
        stop: threading.Event,
    ) -> None:
        self.s = settings
        self.client = client
        self.registry = registry
        self.producer = producer
        self.metrics = bmetrics
        self.stop = stop
        self.applied_seq: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(settings.proxy_urls), len(settings.engine_urls)),
                                        thread_name_prefix="broadcast")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ per poll

    def handle(self, events: list[WeightPublished]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        registered: list[WeightPublished] = []
        for event in plan_events(events).register:
            try:
                self.registry.publish(event.version, event.seq)
                registered.append(event)
            except ValueError as exc:
                _log.error("registry_conflict", version=event.version, seq=event.seq, error=str(exc))
                outcomes.append(self._count(Outcome(event.version, event.seq, "registry_conflict")))
        plan = plan_events(registered)
        for old in plan.superseded:
            outcomes.append(self._count(Outcome(old.version, old.seq, "superseded")))
        if plan.apply is not None:
            outcomes.append(self._count(self.apply(plan.apply)))
        return outcomes

    def _count(self, outcome: Outcome) -> Outcome:
        self.metrics.outcomes.labels(outcome=outcome.outcome).inc()
        _log.info("version_handled", version=outcome.version, seq=outcome.seq, outcome=outcome.outcome,
                  unquiesced=outcome.unquiesced, failed_engines=outcome.failed_engines)
        return outcome

    # ------------------------------------------------------------------ one version

    def _engine_seq(self, label: str | None) -> int | None:
        if not label:
            return None
        raw = self.registry.client.hget(self.registry.keys.registry, label)
        return int(raw) if raw is not None else None  # type: ignore[arg-type]

    def apply(self, event: WeightPublished) -> Outcome:
        infos = list(self._pool.map(self.client.model_info, self.s.engine_urls))
        engine_seqs = [q for q in (self._engine_seq(i.weight_version) for i in infos if i.ok) if q is not None]
        applied = max([*engine_seqs, *([self.applied_seq] if self.applied_seq is not None else [])], default=None)
        action = classify(event, applied, [(i.weight_version, i.digest) if i.ok else (None, None) for i in infos])
        if action is EventAction.OLDER:
            return Outcome(event.version, event.seq, "older")
        if action is EventAction.ALREADY_APPLIED:
            self._announce(event)
            return Outcome(event.version, event.seq, "already_applied")

        unquiesced: list[str] = []
        for attempt in range(1, self.s.max_pause_attempts + 1):
            started = time.monotonic()
            updated: list[EngineAnswer] | None = None
            applied_ok = False
            try:
                self.metrics.pause_rounds.inc()
                answers = list(self._pool.map(
                    lambda p: self.client.pause(p, f"weights {event.version}", self.s.pause_timeout_s),
                    self.s.proxy_urls,
                ))
                decision = after_pause(answers, attempt, self.s.max_pause_attempts)
                for proxy in decision.unquiesced:
                    self.metrics.unquiesced.labels(proxy=proxy).inc()
                unquiesced = decision.unquiesced
                if decision.action is PauseAction.UPDATE:
                    updated = self._update_all(event)
                    applied_ok = all(a.ok for a in updated)
                else:
                    _log.warning("pause_not_quiesced", version=event.version, attempt=attempt,
                                 action=decision.action.value, proxies=decision.unquiesced,
                                 errors=[a.error for a in answers if a.error])
            finally:
                self._resume_all(event.version if applied_ok else None)
            if updated is not None:
                failed = [a.engine for a in updated if not a.ok]
                if failed:
                    return Outcome(event.version, event.seq, "update_failed", failed_engines=failed)
                self.metrics.update_seconds.set(time.monotonic() - started)
                self.applied_seq = max(event.seq, self.applied_seq if self.applied_seq is not None else event.seq)
                self.metrics.applied_seq.set(self.applied_seq)
                self._announce(event)
                return Outcome(event.version, event.seq, "applied")
            if attempt < self.s.max_pause_attempts and self.stop.wait(
                backoff_s(attempt, self.s.backoff_base_s, self.s.backoff_max_s)
            ):
                break  # stopping: leave the version for the next run (offset not committed past it)
        return Outcome(event.version, event.seq, "unquiesced", unquiesced=unquiesced)

    def _update_all(self, event: WeightPublished) -> list[EngineAnswer]:
        def one(engine: str) -> EngineAnswer:
            answer = EngineAnswer(engine=engine, ok=False, error="not attempted")
            for attempt in range(1, self.s.max_update_attempts + 1):
                answer = self.client.update(engine, event.path, event.version, self.s.update_timeout_s,
                                            self.s.abort_all_requests)
                if answer.ok and digest_mismatches(event.digest, {engine: answer.digest}):
                    answer = EngineAnswer(engine=engine, ok=False, weight_version=answer.weight_version,
                                          digest=answer.digest,
                                          error=f"engine reports digest {answer.digest}, event says {event.digest}")
                if answer.ok:
                    return answer
                self.metrics.update_failures.labels(engine=engine).inc()
                _log.error("engine_update_failed", engine=engine, version=event.version, attempt=attempt,
                           error=answer.error)
            return answer

        return list(self._pool.map(one, self.s.engine_urls))

    def _resume_all(self, version: str | None) -> None:
        errors = list(self._pool.map(lambda p: self.client.resume(p, version), self.s.proxy_urls))
        for proxy, error in zip(self.s.proxy_urls, errors, strict=True):
            if error:
                self.metrics.resume_failures.labels(proxy=proxy).inc()
                _log.error("resume_failed", proxy=proxy, version=version, error=error)

    def _announce(self, event: WeightPublished) -> None:
        applied = WeightApplied(version=event.version, seq=event.seq, digest=event.digest,
                                engines=list(self.s.engine_urls))
        self.producer.send(self.s.topics.weights, applied)
        _log.info("weights_applied", version=event.version, seq=event.seq, digest=event.digest)

    def recover(self) -> None:
        """At start: resume every proxy (a previous run may have died between pause and resume)."""
        self._resume_all(None)


def run(settings: BroadcasterSettings, stop: threading.Event | None = None) -> None:
    """Consume ``weights`` until ``stop`` is set."""
    stop = stop or threading.Event()
    bmetrics = BroadcasterMetrics(CollectorRegistry(auto_describe=True))
    last_poll = [time.monotonic()]

    def health() -> tuple[bool, dict[str, object]]:
        stalled = time.monotonic() - last_poll[0] > max(120.0, settings.pause_timeout_s * 2 + 60.0)
        return not stalled, {"status": "stalled" if stalled else "ok"}

    redis_client = connect(settings.redis)
    registry = RedisRegistry(redis_client, RedisKeys(settings.redis.key_prefix))
    client = ControlClient(settings.admin_token, settings.http_timeout_s)
    producer = Producer(settings.kafka, client_suffix="broadcaster")
    consumer = Consumer(
        settings.kafka, [settings.topics.weights], settings.consumer_group, client_suffix="broadcaster",
        on_decode_error=lambda topic, _p, _o, exc: bmetrics.decode_errors.inc(
            topic, exc.reason if isinstance(exc, DecodeError) else "unknown"),
    )
    server = StatusServer(settings.metrics_host, settings.metrics_port, bmetrics.registry, health).start()
    broadcaster = Broadcaster(settings, client, registry, producer, bmetrics, stop)
    _log.info("broadcaster_ready", proxies=settings.proxy_urls, engines=settings.engine_urls, port=server.port)
    try:
        broadcaster.recover()
        while not stop.is_set():
            polled: list[Polled] = consumer.poll(settings.poll_timeout_s)
            last_poll[0] = time.monotonic()
            events = [p.record for p in polled if isinstance(p.record, WeightPublished)]
            if events:
                broadcaster.handle(events)
            positions: dict[tuple[str, int], int] = {}
            for p in polled:
                positions[(p.topic, p.partition)] = max(p.offset + 1, positions.get((p.topic, p.partition), 0))
            if positions and not stop.is_set():
                consumer.commit(positions)
    finally:
        broadcaster.close()
        server.stop()
        consumer.close()
        producer.close()
        client.close()
        redis_client.close()
