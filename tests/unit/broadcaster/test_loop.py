"""The broadcaster's sequence of calls, with fake proxies, engines, registry and producer: pause, update,
verify and resume in that order, retried or given up within bounds, and applied to the proxies and
engines that registered as well as the configured ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.weight_broadcaster.settings import BroadcasterSettings
from shared.schemas import WeightApplied
from shared.settings import load
from tests.support.broadcaster_fakes import _value, ev, make


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
