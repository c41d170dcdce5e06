"""Two engine replicas that register themselves: the proxy spreads sessions over both, the broadcaster
updates both, and the run goes on when one dies (its sessions end on record, its registration lapses);
a proxy finding engines on its own is in ``tests/integration/proxy/test_engine_registry.py``.

The local stack with ``engines=2``: each engine registers ``REIN_ADVERTISE_URL`` in Redis, the proxy has
no ``REIN_ENGINE_URLS`` (``REIN_DISCOVER_ENGINES``) and neither has the broadcaster.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ops.local.stack import LocalStack, SharedInfra, start
from shared.membership import Members
from shared.schemas import SessionFinished, SessionRejected, WeightApplied
from shared.state import client_for
from tests.support.fault_runs import PROGRESS_TIMEOUT_S, assert_nothing_lost_or_trained_twice, read_chunks
from tests.support.readback import engine_info, kill_replica, small_stack, stop_and_read, trained_steps
from tests.support.wait import wait_on_stack

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

ENGINES = ("engine-0", "engine-1")


def _version(local: LocalStack, name: str) -> str:
    return str(engine_info(local, name)["weight_version"])


def _generating(local: LocalStack, name: str) -> int:
    """Requests engine ``name`` is generating now."""
    return len(httpx.get(f"{local.urls[name]}/debug/active", timeout=5).json()["requests"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, stack_infra: Callable[[str], SharedInfra]) -> dict[str, Any]:
    config = small_stack(tmp_path_factory.mktemp("engines"), engines=2, shared_infra=stack_infra("engines"), services={
        "engine": {"heartbeat_s": 0.5, "registration_ttl_s": 3}, "proxy": {"engine_health_interval_s": 0.5}})
    local = start(config)
    redis = client_for(local.infra.redis_settings())
    members = Members(redis, local.config.redis_keys, "engine")
    data: dict[str, Any] = {"urls": dict(local.urls)}
    try:
        data["registered"] = members.live(forget=False)
        wait_on_stack("two trainer steps", lambda: trained_steps(local) >= 2, PROGRESS_TIMEOUT_S, local)
        wait_on_stack("both engines on one version", lambda: _version(local, "engine-0") == _version(
            local, "engine-1") != "v0", 60, local)

        # One engine dies: its sessions are lost on record, its registration lapses, the other carries the run.
        # Killed mid-generation, so it has sessions to lose: paced, the engines idle between waves.
        wait_on_stack("engine-1 generating for two sessions", lambda: _generating(local, "engine-1") >= 2,
                      PROGRESS_TIMEOUT_S, local, interval_s=0.02)
        data |= kill_replica(local, "engine-1", members, [local.urls["engine-0"]], PROGRESS_TIMEOUT_S)
        data |= stop_and_read(local, allow_dead=("engine-1",))
        data["chunks"] = read_chunks(local)
        print(f"\nengine replicas: registration lapsed {data['lapsed_s']} s after the kill, two steps with one "
              f"engine in {data['two_steps_s']} s, {len(data['rows'])} steps")
    finally:
        redis.close()
        local.stop()
    return data


def test_both_engines_registered_served_and_were_updated(run: dict[str, Any]) -> None:
    engines = [run["urls"][n] for n in ENGINES]
    assert run["registered"] == sorted(engines)
    sessions: dict[str, int] = defaultdict(int)
    for chunk in run["chunks"]:
        sessions[chunk.engine] += 1
    assert all(sessions[e] > 0 for e in engines), f"chunks per engine: {dict(sessions)}"
    applied = [r for r in run["weights"] if isinstance(r, WeightApplied)]
    assert any(sorted(r.engines) == sorted(engines) for r in applied), "no version was applied on both engines"
    assert applied[-1].engines == [run["urls"]["engine-0"]], "after the kill, the live engine only"


def test_each_session_ran_on_one_engine(run: dict[str, Any]) -> None:
    engines: dict[str, set[str]] = defaultdict(set)
    for chunk in run["chunks"]:
        engines[chunk.session_id].add(chunk.engine)
    moved = {s: e for s, e in engines.items() if len(e) > 1}
    assert not moved, f"sessions whose chunks came from two engines: {list(moved.items())[:5]}"


def test_the_dead_engines_sessions_ended_on_record_and_the_run_went_on(run: dict[str, Any]) -> None:
    """A session whose engine died ends on record as failed: rejected by the proxy (``engine_lost`` once the
    engine is out, or the call that was cut after it published), or finished ``failed`` by the runner that got
    the 503; either way its group is retried. Only sessions on the dead engine (or with no tokens yet, routed
    there at the kill) end so."""
    dead = run["urls"]["engine-1"]
    engines: dict[str, set[str]] = defaultdict(set)
    for chunk in run["chunks"]:
        engines[chunk.session_id].add(chunk.engine)
    lost = {r.session_id for r in run["events"]  # the runner may add its own end (session_lost) after the proxy's
            if (isinstance(r, SessionRejected) or (isinstance(r, SessionFinished) and r.status == "failed"))
            and r.error in ("engine_lost", "engine_unavailable")}
    assert lost, "no session ended for its engine's death"
    elsewhere = {s for s in lost if engines.get(s, {dead}) != {dead}}
    assert not elsewhere, f"sessions of the live engine ended as lost: {sorted(elsewhere)[:5]}"
    assert_nothing_lost_or_trained_twice(run)
