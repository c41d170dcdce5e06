"""The broadcaster's sequence of calls, with fake proxies, engines, registry and producer."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.weight_broadcaster.clients import EngineAnswer
from services.weight_broadcaster.decide import PauseAnswer
from services.weight_broadcaster.loop import Broadcaster
from services.weight_broadcaster.metrics import BroadcasterMetrics
from services.weight_broadcaster.settings import BroadcasterSettings
from shared.schemas import Record, WeightApplied, WeightPublished
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
        self.sent: list[Record] = []

    def send(self, topic: str, record: Record, key: str | None = None) -> Any:
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


def test_pause_update_resume_announce() -> None:
    b, client, registry, producer = make([True])
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "applied"
    kinds = [c[0] for c in client.calls]
    assert kinds == ["pause", "pause", "update", "update", "resume", "resume"]  # a short round: no renewal
    resumes = {c for c in client.calls if c[0] == "resume"}
    assert resumes == {("resume", "http://p1", "v1"), ("resume", "http://p2", "v1")}
    assert registry.published == [("v1", 1)]
    assert producer.sent == [WeightApplied(version="v1", seq=1, digest="d1", engines=["http://e1", "http://e2"],
                                           ts=producer.sent[0].ts)]
    b.close()


def test_unquiesced_never_updates_then_retries() -> None:
    b, client, _, _ = make([False, True])
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "applied"
    first_round = client.calls[: client.calls.index(("pause", "http://p1"), 1)]
    assert not any(c[0] == "update" for c in first_round)
    assert ("resume", "http://p1", "None") in first_round  # resumed before backing off
    assert _value(b, "rein_broadcaster_unquiesced_total", proxy="http://p1") == 1.0
    b.close()


def test_gives_up_after_bounded_attempts_without_updating() -> None:
    b, client, _, producer = make([False], max_pause_attempts=3)
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "unquiesced"
    assert not any(c[0] == "update" for c in client.calls)
    assert sum(1 for c in client.calls if c[0] == "pause") == 6
    assert sum(1 for c in client.calls if c[0] == "resume") == 6
    assert producer.sent == []
    assert _value(b, "rein_broadcaster_unquiesced_total", proxy="http://p2") == 3.0
    b.close()


def test_newest_only_older_skipped_replay_idempotent() -> None:
    b, client, registry, producer = make([True])
    outcomes = b.handle([ev(2), ev(1), ev(3)])
    assert [(o.version, o.outcome) for o in outcomes] == [("v1", "superseded"), ("v2", "superseded"),
                                                          ("v3", "applied")]
    assert [c[2] for c in client.calls if c[0] == "update"] == ["v3", "v3"]
    assert registry.published == [("v1", 1), ("v2", 2), ("v3", 3)]
    client.calls.clear()
    assert [o.outcome for o in b.handle([ev(2)])] == ["older"]
    assert [o.outcome for o in b.handle([ev(3)])] == ["already_applied"]
    assert client.calls == []  # no pause, no update on a replay
    assert [r.version for r in producer.sent] == ["v3", "v3"]  # re-announced (idempotent by key)
    b.close()


def test_registry_conflict_is_counted_not_applied() -> None:
    b, client, registry, _ = make([True])
    registry.seq_of["v1"] = 7
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "registry_conflict"
    assert client.calls == []
    b.close()


def test_wrong_digest_is_a_failed_update_and_resumes_without_version() -> None:
    b, client, _, producer = make([True], max_update_attempts=2)
    client.digest["/w/v1.pt"] = "tampered"
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "update_failed"
    assert outcome.failed_engines == ["http://e1", "http://e2"]
    assert sum(1 for c in client.calls if c[0] == "update") == 4
    assert {c for c in client.calls if c[0] == "resume"} == {("resume", "http://p1", "None"),
                                                             ("resume", "http://p2", "None")}
    assert producer.sent == []
    b.close()


def test_engines_without_digest_are_verified_by_their_label() -> None:
    b, client, _, producer = make([True])
    client.report_digest = False
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "applied"
    for i, call in enumerate(client.calls):
        if call[0] == "update":  # each update is followed by a read of what that engine serves
            assert any(engine == call[1] and before > i for engine, before in client.info_reads), call
    assert [type(r).__name__ for r in producer.sent] == ["WeightApplied"]
    [again] = b.handle([ev(1)])  # replay: the engines already report v1
    assert again.outcome == "already_applied"
    b.close()


def test_an_engine_that_keeps_its_label_failed_the_update() -> None:
    b, client, _, producer = make([True], max_update_attempts=1)
    client.report_digest, client.ignore_version = False, True
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "update_failed" and outcome.failed_engines == ["http://e1", "http://e2"]
    assert producer.sent == []
    b.close()


@pytest.mark.parametrize("keeps_label", [False, True])
def test_an_update_answer_that_says_what_is_served_is_verified_without_another_read(keeps_label: bool) -> None:
    b, client, _, producer = make([True], max_update_attempts=1)
    client.update_says_served, client.ignore_version = True, keeps_label
    [outcome] = b.handle([ev(1)])
    first_update = next(i for i, call in enumerate(client.calls) if call[0] == "update")
    assert all(before <= first_update for _, before in client.info_reads)  # none between pause and resume
    if keeps_label:
        assert outcome.outcome == "update_failed" and producer.sent == []
        assert ("resume", "http://p1", "None") in client.calls
    else:
        assert outcome.outcome == "applied" and [type(r).__name__ for r in producer.sent] == ["WeightApplied"]
        assert ("resume", "http://p1", "v1") in client.calls
    b.close()


def test_settings_reject_bad_urls() -> None:
    from shared.settings import SettingsError

    with pytest.raises(SettingsError, match="REIN_PROXY_URLS"):
        load(BroadcasterSettings, admin_token="t" * 16, proxy_urls=["ftp://x"])


def test_reconcile_reloads_the_newest_version_on_an_engine_that_restarted() -> None:
    b, client, _, producer = make([True])
    assert b.reconcile() is None  # nothing applied yet: nothing to restore
    b.handle([ev(1), ev(2)])
    client.calls.clear()
    assert b.reconcile() is None  # every engine serves v2
    assert client.calls == []

    client.engine_version["http://e2"] = "v0"  # e2 crashed and came back on its start checkpoint
    outcome = b.reconcile()
    assert outcome is not None and outcome.outcome == "applied" and outcome.version == "v2"
    assert [c[0] for c in client.calls] == ["pause", "pause", "update", "update", "resume", "resume"]
    assert client.engine_version == {"http://e1": "v2", "http://e2": "v2"}
    assert isinstance(producer.sent[-1], WeightApplied) and producer.sent[-1].version == "v2"
    assert _value(b, "rein_broadcaster_reconciles_total") == 1.0
    b.close()


def test_reconcile_never_rolls_an_engine_back() -> None:
    b, client, registry, _ = make([True])
    b.handle([ev(1)])
    registry.publish("v3", 3)
    client.engine_version["http://e1"] = "v3"  # loaded by someone else, newer than what we applied
    client.calls.clear()
    assert b.reconcile() is None
    assert client.calls == []
    b.close()


def test_recover_learns_the_newest_applied_version_from_the_topic() -> None:
    b, client, _, _ = make([True])
    applied = [WeightApplied(version=f"v{i}", seq=i, digest=f"d{i}", engines=[]) for i in (1, 2)]
    b.recover([ev(1), ev(2), ev(3), *applied])  # v3 was published but never applied
    assert b.latest is not None and (b.latest.version, b.latest.seq, b.latest.path) == ("v2", 2, "/w/v2.pt")
    assert b.applied_seq == 2
    client.engine_version.update({"http://e1": "v2", "http://e2": "v1"})
    outcome = b.reconcile()
    assert outcome is not None and outcome.version == "v2"
    b.close()


def test_a_pause_lost_before_the_update_means_no_update_and_another_round() -> None:
    """A proxy whose lease ran out (it resumed by itself) refuses the renew: the engines are not
    touched in that round, every proxy is resumed, and the next round (a new pause id) applies it."""
    b, client, _, producer = make([True], max_pause_attempts=2, pause_lease_s=1e-6)  # every round is long
    client.renew_errors = ["HTTP 409: stale_pause"]
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "applied"
    kinds = [c[0] for c in client.calls]
    assert kinds[:6] == ["pause", "pause", "renew", "renew", "resume", "resume"]
    assert kinds.count("update") == 2 and kinds.index("update") > 6
    assert len(set(client.pause_ids)) == 2  # one id per round
    assert _value(b, "rein_broadcaster_pause_leases_lost_total", proxy="http://p1") == 1.0
    assert [r.version for r in producer.sent if isinstance(r, WeightApplied)] == ["v1"]


def test_engines_that_can_stage_read_the_checkpoint_before_the_pause() -> None:
    """rein's engines are asked to stage each version before any proxy is paused; engines without
    the route (SGLang's 404) are asked once, then never again."""
    b, client, _, _ = make([True])
    client.stages = client.update_says_served = True
    b.handle([ev(1)])
    assert [c[0] for c in client.calls] == ["stage", "stage", "pause", "pause", "update", "update", "resume",
                                            "resume"]
    assert {c for c in client.calls if c[0] == "stage"} == {("stage", "http://e1", "/w/v1.pt"),
                                                            ("stage", "http://e2", "/w/v1.pt")}
    assert _value(b, "rein_broadcaster_staged_updates_total", engine="http://e1") == 1.0
    b.close()

    b, client, _, _ = make([True])
    b.handle([ev(1)])
    b.handle([ev(2)])
    assert sorted(client.stage_asks) == ["http://e1", "http://e2"]
    assert [o.outcome for o in b.handle([ev(3)])] == ["applied"]
    b.close()


class StubMembers:
    """Registered proxies as a broadcaster sees them on successive reads (the last answer repeats)."""

    def __init__(self, *reads: list[str]) -> None:
        self.reads = list(reads)

    def live(self) -> list[str]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


@dataclass
class StubPauses:
    log: list[tuple[str, ...]] = field(default_factory=list)

    def hold(self, pause_id: str, reason: str, lease_s: float) -> None:
        self.log.append(("hold", pause_id))

    def renew(self, lease_s: float) -> None:
        self.log.append(("renew",))

    def end(self, pause_id: str) -> None:
        self.log.append(("end", pause_id))


def test_registered_proxies_are_paused_with_the_configured_ones_late_joiners_included() -> None:
    """p3 registers while the round is pausing: it is paused before the engines change, and resumed with
    the others; p4, registered after the update, is resumed too (it joined the recorded pause)."""
    b, client, _, _ = make([True], proxy_urls=["http://p1"])
    pauses = StubPauses()
    b.members = StubMembers(["http://p2"], ["http://p2", "http://p3"], ["http://p2", "http://p3", "http://p4"])  # type: ignore[assignment]
    b.pauses = pauses  # type: ignore[assignment]
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "applied"
    first_update = next(i for i, c in enumerate(client.calls) if c[0] == "update")
    assert {c[1] for c in client.calls[:first_update] if c[0] == "pause"} == {"http://p1", "http://p2", "http://p3"}
    assert {c[1] for c in client.calls if c[0] == "resume"} == {"http://p1", "http://p2", "http://p3", "http://p4"}
    [pause_id] = set(client.pause_ids)
    assert pauses.log[0] == ("hold", pause_id), "the pause is recorded before any proxy is paused"
    assert pauses.log[-1] == ("end", pause_id)
    b.close()


def test_registered_engines_are_updated_with_the_configured_ones_and_named_as_applied() -> None:
    b, client, _, producer = make([True], engine_urls=["http://e1"])
    b.engine_members = StubMembers(["http://e2", "http://e3"])  # type: ignore[assignment]
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "applied"
    assert sorted(c[1] for c in client.calls if c[0] == "update") == ["http://e1", "http://e2", "http://e3"]
    applied = producer.sent[-1]
    assert isinstance(applied, WeightApplied) and applied.engines == ["http://e1", "http://e2", "http://e3"]
    b.close()


def test_a_registered_engine_that_does_not_answer_is_left_out_and_reported_a_fixed_one_fails_the_version() -> None:
    b, client, _, producer = make([True], engine_urls=["http://e1"])
    b.engine_members = StubMembers(["http://e2"])  # type: ignore[assignment]
    client.down = {"http://e2"}  # died; its registration has not lapsed yet
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "applied", "a dead replica must not hold every version back"
    assert [c[1] for c in client.calls if c[0] == "update"] == ["http://e1"]
    assert isinstance(producer.sent[-1], WeightApplied) and producer.sent[-1].engines == ["http://e1"]
    assert _value(b, "rein_broadcaster_engines_lagging_total") == 1.0

    client.down = {"http://e1"}  # a fixed engine is promised: its failure fails the version, as before
    client.engine_version["http://e2"] = "v1"
    [outcome] = b.handle([ev(2)])
    assert outcome.outcome == "update_failed" and outcome.failed_engines == ["http://e1"]
    b.close()


def test_no_engine_at_all_fails_the_version_without_a_pause() -> None:
    b, client, _, producer = make([True], engine_urls=[])
    b.engine_members = StubMembers(["http://e9"])  # type: ignore[assignment]
    client.down = {"http://e9"}
    [outcome] = b.handle([ev(1)])
    assert outcome.outcome == "update_failed" and outcome.failed_engines == ["http://e9"]
    assert client.calls == [] and producer.sent == []
    b.close()


def test_reconcile_brings_an_engine_that_registered_on_its_start_checkpoint_up_to_the_newest() -> None:
    b, client, _, _ = make([True], engine_urls=["http://e1"])
    members = StubMembers([])
    b.engine_members = members  # type: ignore[assignment]
    b.handle([ev(1), ev(2)])
    members.reads = [["http://e2"]]  # joined, serving v0
    client.calls.clear()
    outcome = b.reconcile()
    assert outcome is not None and outcome.outcome == "applied" and outcome.version == "v2"
    assert client.engine_version["http://e2"] == "v2"
    assert _value(b, "rein_broadcaster_engines_lagging_total") == 1.0
    b.close()
