"""The broadcaster's recovery, with fake proxies, engines, registry and producer: on a restart it learns
the newest applied version from the topic, and between versions it brings back an engine that restarted
on its start checkpoint, never rolling back one that serves a newer version."""

from __future__ import annotations

from shared.schemas import WeightApplied
from tests.support.broadcaster_fakes import _value, ev, make


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
