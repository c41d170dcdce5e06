"""The weight broadcaster: the control plane's one driver (pause, update, resume).

:class:`Broadcaster` handles what the process (:mod:`services.weight_broadcaster.service`) reads from
``weights`` (consumer group ``consumer_group``, manual commit after the work is done): it reacts to
``WeightPublished`` and produces ``WeightApplied`` on the same topic (key = ``<version>:applied``).
Publishes each version into the Redis registry before loading it (as every collector replica does
from the same topic: ``shared.state``).

Per poll: register every new version in sequence order; of the versions in the
poll only the newest is loaded (older ones are superseded). For that version:
skip it if the engines already serve something newer, re-announce it if they
already serve it (a replay after a crash), else: have every engine that can read the
checkpoint ahead (rein's ``/stage_weights``; the proxies still run) → pause every proxy (with a pause
id and a lease) → if any did not quiesce, resume all, back off and retry (bounded,
then give the version up) → if the round took over a third of the lease, renew the pause
on every proxy (one that no longer holds it, its lease ran out, counts as unquiesced) → load
it on every engine, renewing the lease meanwhile, and check what each then serves (the label, and the digest where the
engine reports one: from rein's update answer, else ``/get_model_info``) → resume every
proxy (always, in ``finally``, naming the pause; with the version when it was applied) → publish
``WeightApplied``. Killed mid-update, the proxies resume by themselves when the lease
runs out. Offsets are committed once the poll's events are handled, so
a crash replays them and the replay is idempotent.

Every ``reconcile_interval_s`` it also checks what each engine serves (the configured ones and
those registered in Redis, as for every update): an engine that
restarted on its start checkpoint, or joined on one, gets the newest applied version loaded again (the
same pause → update → resume). A Redis or Kafka outage is waited out: the poll's
records are handled again once the dependency is back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from services.weight_broadcaster.clients import ControlClient, EngineAnswer
from services.weight_broadcaster.decide import (
    EventAction,
    PauseAction,
    PauseAnswer,
    after_pause,
    backoff_s,
    classify,
    latest_applied,
    not_served,
    plan_events,
    renew_before_update,
    update_targets,
)
from services.weight_broadcaster.metrics import BroadcasterMetrics
from services.weight_broadcaster.settings import BroadcasterSettings
from shared import log
from shared.bus import Producer
from shared.membership import Members
from shared.outage import DEPENDENCY_ERRORS
from shared.pause_record import PauseRecord
from shared.schemas import WeightApplied, WeightPublished, new_id
from shared.state import RedisRegistry

_log = log.get(__name__)


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
        members: Members | None = None,
        pauses: PauseRecord | None = None,
        engine_members: Members | None = None,
    ) -> None:
        self.s = settings
        self.client = client
        self.registry = registry
        self.producer = producer
        self.metrics = bmetrics
        self.stop = stop
        self.applied_seq: int | None = None
        self.latest: WeightPublished | None = None
        """The newest version applied: what :meth:`reconcile` puts back on an engine that lost it."""
        self._no_stage: set[str] = set()
        """Engines without rein's ``/stage_weights`` (SGLang): not asked again."""
        self.members = members
        """Proxies that registered themselves (``REIN_ADVERTISE_URL``): paused with the configured ones."""
        self.pauses = pauses
        """The pause in progress, in Redis for proxies that start during it."""
        self.engine_members = engine_members
        """Engines that registered themselves: updated with the configured ones."""
        self._pool = ThreadPoolExecutor(max_workers=max(8, len(settings.proxy_urls), len(settings.engine_urls)),
                                        thread_name_prefix="broadcast")

    def proxies(self) -> list[str]:
        """Every proxy to pause: the configured ones and the live registered ones."""
        return sorted({*self.s.proxy_urls, *(self.members.live() if self.members else ())})

    def engines(self) -> list[str]:
        """Every engine to update: the configured ones and the live registered ones."""
        return sorted({*self.s.engine_urls, *(self.engine_members.live() if self.engine_members else ())})

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
        return self.registry.seqs([label])[0]

    def apply(self, event: WeightPublished) -> Outcome:
        known = list(self._pool.map(self.client.model_info, self.engines()))
        targets, skipped = update_targets([(i.engine, i.ok) for i in known], self.s.engine_urls)
        if skipped:
            self._lagging(skipped, event, "unreachable: not updated")
        if not targets:
            _log.error("no_engine_to_update", version=event.version, skipped=skipped)
            return Outcome(event.version, event.seq, "update_failed", failed_engines=skipped)
        infos = [i for i in known if i.engine in targets]
        engine_seqs = [q for q in (self._engine_seq(i.weight_version) for i in infos if i.ok) if q is not None]
        applied = max([*engine_seqs, *([self.applied_seq] if self.applied_seq is not None else [])], default=None)
        action = classify(event, applied, [(i.weight_version, i.digest) if i.ok else (None, None) for i in infos])
        if action is EventAction.OLDER:
            return Outcome(event.version, event.seq, "older")
        if action is EventAction.ALREADY_APPLIED:
            self._announce(event, targets)
            self._applied(event)
            return Outcome(event.version, event.seq, "already_applied")

        self._stage_all(event, targets)
        unquiesced: list[str] = []
        reason = f"weights {event.version}"
        for attempt in range(1, self.s.max_pause_attempts + 1):
            started = time.monotonic()
            updated: list[EngineAnswer] | None = None
            applied_ok = False
            pause_id = new_id("pause")
            marks: dict[str, float] = {}
            proxies: list[str] = []
            try:
                # Recorded first: a proxy that starts from here on starts paused under it.
                if self.pauses:
                    self.pauses.hold(pause_id, reason, self.s.pause_lease_s)
                proxies = self.proxies()
                self.metrics.pause_rounds.inc()
                pause = partial(self._pause_one, reason=reason, pause_id=pause_id)
                answers = list(self._pool.map(pause, proxies))
                # One that registered during the round is paused too (it joined the recorded pause already).
                late = [p for p in self.proxies() if p not in proxies]
                answers += list(self._pool.map(pause, late))
                proxies += late
                marks["pause"] = time.monotonic()
                decision = after_pause(answers, attempt, self.s.max_pause_attempts)
                renew = decision.action is PauseAction.UPDATE and renew_before_update(
                    marks["pause"] - started, self.s.pause_lease_s)
                lost = self._renew_all(pause_id, proxies) if renew else []
                marks["renew"] = time.monotonic()
                for proxy in decision.unquiesced:
                    self.metrics.unquiesced.labels(proxy=proxy).inc()
                unquiesced = decision.unquiesced + lost
                if decision.action is PauseAction.UPDATE and not lost:
                    with _LeaseKeeper(partial(self._renew_all, pause_id, proxies), self.s.pause_lease_s / 3):
                        updated = self._update_all(event, targets)
                    marks["update"] = time.monotonic()
                    applied_ok = all(a.ok for a in updated)
                else:
                    _log.warning("pause_not_quiesced", version=event.version, attempt=attempt,
                                 action=decision.action.value, proxies=unquiesced, lease_lost=lost,
                                 errors=[a.error for a in answers if a.error])
            finally:
                self._end_round(pause_id, event.version if applied_ok else None, proxies)
                marks["resume"] = time.monotonic()
                _log.info("update_round", version=event.version, attempt=attempt, pause_id=pause_id,
                          **_phases(started, marks))
            if updated is not None:
                failed = [a.engine for a in updated if not a.ok]
                if failed:
                    return Outcome(event.version, event.seq, "update_failed", failed_engines=failed)
                self.metrics.update_seconds.set(time.monotonic() - started)
                self._announce(event, targets)
                self._applied(event)
                return Outcome(event.version, event.seq, "applied")
            if attempt < self.s.max_pause_attempts and self.stop.wait(
                backoff_s(attempt, self.s.backoff_base_s, self.s.backoff_max_s)
            ):
                break  # stopping: leave the version for the next run (offset not committed past it)
        return Outcome(event.version, event.seq, "unquiesced", unquiesced=unquiesced)

    def _stage_all(self, event: WeightPublished, targets: list[str]) -> None:
        """Have every engine that can (rein's) read the checkpoint before the proxies are paused, so
        the update inside the pause only swaps it in. Best effort: an engine that failed to stage
        reads the file in the update, which reports any real problem."""
        engines = [e for e in targets if e not in self._no_stage]
        answers = self._pool.map(lambda e: self.client.stage(e, event.path, self.s.update_timeout_s), engines)
        for engine, error in zip(engines, answers, strict=True):
            if error is None:
                self._no_stage.add(engine)
            elif error:
                _log.warning("stage_failed", engine=engine, version=event.version, error=error)

    def _update_all(self, event: WeightPublished, targets: list[str]) -> list[EngineAnswer]:
        def one(engine: str) -> EngineAnswer:
            answer = EngineAnswer(engine=engine, ok=False, error="not attempted")
            for attempt in range(1, self.s.max_update_attempts + 1):
                answer = self.client.update(engine, event.path, event.version, self.s.update_timeout_s,
                                            self.s.abort_all_requests)
                if answer.ok:
                    answer = self._verify(engine, event, answer)
                if answer.ok:
                    if answer.staged:
                        self.metrics.staged_updates.labels(engine=engine).inc()
                    return answer
                self.metrics.update_failures.labels(engine=engine).inc()
                _log.error("engine_update_failed", engine=engine, version=event.version, attempt=attempt,
                           error=answer.error)
            return answer

        return list(self._pool.map(one, targets))

    def _verify(self, engine: str, event: WeightPublished, updated: EngineAnswer) -> EngineAnswer:
        """After a successful update: what the engine serves must be the event's label (and its
        digest, where the engine reports one), else the update failed. Read from the update's answer
        where it says (rein's engine), else from ``/get_model_info`` (one round trip less while
        the proxies are paused)."""
        info = updated if updated.served else self.client.model_info(engine)
        error = not_served(event, info.weight_version, info.digest) if info.ok else info.error
        if error:
            return EngineAnswer(engine=engine, ok=False, weight_version=info.weight_version, digest=info.digest,
                                error=f"after the update: {error}")
        return info

    def _end_round(self, pause_id: str, version: str | None, proxies: list[str]) -> None:
        """Forget the recorded pause (first: a proxy that starts from here on must not wait for a resume),
        then resume the round's proxies and any registered since. Redis failing here must not keep the
        round's proxies paused: they are resumed regardless (the record expires with its lease)."""
        targets = set(proxies)
        try:
            if self.pauses:
                self.pauses.end(pause_id)
            targets.update(self.proxies())
        except DEPENDENCY_ERRORS as exc:
            _log.warning("pause_record_not_ended", pause_id=pause_id, error=str(exc))
        self._resume_all(version, pause_id, sorted(targets))

    def _pause_one(self, proxy: str, reason: str, pause_id: str) -> PauseAnswer:
        return self.client.pause(proxy, reason, self.s.pause_timeout_s, pause_id, self.s.pause_lease_s)

    def _renew_all(self, pause_id: str, proxies: list[str]) -> list[str]:
        """Renew ``pause_id`` on every proxy of the round (and its record); the proxies that refused or missed it."""
        if self.pauses:
            self.pauses.renew(self.s.pause_lease_s)
        errors = list(self._pool.map(lambda p: self.client.renew(p, pause_id, self.s.pause_lease_s), proxies))
        lost = [proxy for proxy, error in zip(proxies, errors, strict=True) if error]
        for proxy, error in zip(proxies, errors, strict=True):
            if error:
                self.metrics.leases_lost.labels(proxy=proxy).inc()
                _log.warning("pause_lease_lost", proxy=proxy, pause_id=pause_id, error=error)
        return lost

    def _resume_all(self, version: str | None, pause_id: str | None = None, proxies: list[str] | None = None) -> None:
        targets = self.proxies() if proxies is None else proxies
        errors = list(self._pool.map(lambda p: self.client.resume(p, version, pause_id), targets))
        for proxy, error in zip(targets, errors, strict=True):
            if error:
                self.metrics.resume_failures.labels(proxy=proxy).inc()
                _log.error("resume_failed", proxy=proxy, version=version, pause_id=pause_id, error=error)

    def _lagging(self, engines: list[str], event: WeightPublished, why: str) -> None:
        self.metrics.lagging.inc(len(engines))
        _log.warning("engines_lagging", version=event.version, seq=event.seq, engines=engines, why=why)

    def _announce(self, event: WeightPublished, engines: list[str]) -> None:
        applied = WeightApplied(version=event.version, seq=event.seq, digest=event.digest,
                                engines=engines, last_index=event.last_index)
        self.producer.send(self.s.topics.weights, applied)
        _log.info("weights_applied", version=event.version, seq=event.seq, digest=event.digest)

    def _applied(self, event: WeightPublished) -> None:
        self.applied_seq = max(event.seq, self.applied_seq if self.applied_seq is not None else event.seq)
        self.metrics.applied_seq.set(self.applied_seq)
        if self.latest is None or event.seq >= self.latest.seq:
            self.latest = event

    def reconcile(self) -> Outcome | None:
        """Load the newest applied version again on every engine that serves an older or unknown one.

        An engine that restarts loads its start checkpoint (``v0``): left alone, everything it
        generates falls outside the window, no batch fills, no new version comes, and the run
        stalls. Engines that cannot be reached are skipped (they are retried next time)."""
        latest = self.latest
        if latest is None:
            return None
        infos = list(self._pool.map(self.client.model_info, self.engines()))
        behind = []
        for info in infos:
            if not info.ok or not not_served(latest, info.weight_version, info.digest):
                continue
            seq = self._engine_seq(info.weight_version)
            if seq is None or seq < latest.seq:
                behind.append(f"{info.engine} ({info.weight_version})")
        if not behind:
            return None
        self.metrics.reconciles.inc()
        self._lagging(behind, latest, "serves an older version: reloading the newest")
        return self._count(self.apply(latest))

    def recover(self, weights: Sequence[object] = ()) -> None:
        """At start: resume every proxy (a previous run may have died between pause and resume), and
        learn the newest applied version from ``weights`` read back (for :meth:`reconcile`)."""
        self._resume_all(None)
        if weights:
            latest = latest_applied(weights)
            if latest is not None:
                self._applied(latest)


def _phases(started: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds each phase of a round took, as the broadcaster saw it (``pause_s``: until every
    answer was in; then ``renew_s``, ``update_s``, ``resume_s``), and ``total_s``."""
    out: dict[str, float] = {}
    last = started
    for name, at in marks.items():
        out[f"{name}_s"] = round(at - last, 4)
        last = at
    out["total_s"] = round(last - started, 4)
    return out


class _LeaseKeeper:
    """Calls ``renew`` every ``interval_s`` on its own thread while the ``with`` block runs (the update)."""

    def __init__(self, renew: Callable[[], object], interval_s: float) -> None:
        self._renew, self._interval_s = renew, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pause-lease", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._renew()

    def __enter__(self) -> _LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
