"""Two proxy replicas behind HAProxy: sessions stay on one proxy, every update pauses both, and the run
goes on when one dies (its registration lapses; a newcomer joining a pause is in
``tests/integration/proxy/test_membership.py``).

The local stack with ``proxies=2``: each proxy registers itself in Redis (``REIN_ADVERTISE_URL``), the
broadcaster has no ``REIN_PROXY_URLS`` and finds them there, and ``deploy/haproxy.sh`` balances agents'
calls by session (a key in the path, else ``X-Session-Id``, else the API key). The rollout runner
(multi-call sessions, then a finish) reaches the proxies through HAProxy only.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
import pytest

from ops.local.stack import LocalStack, start
from shared.membership import Members
from shared.names import RedisKeys
from shared.schemas import SessionFinished
from shared.state import client_for
from tests.support.fault_runs import PROGRESS_TIMEOUT_S, assert_nothing_lost_or_trained_twice, read_chunks
from tests.support.readback import engine_info, kill_replica, small_stack, stop_and_read, trained_steps
from tests.support.wait import wait_on_stack

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]


def _state(local: LocalStack, name: str) -> dict[str, Any]:
    answer = httpx.get(f"{local.urls[name]}/v1/rollout/state", timeout=5,
                       headers={"Authorization": f"Bearer {local.credentials.admin_token}"})
    answer.raise_for_status()
    state: dict[str, Any] = answer.json()
    return state


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = small_stack(tmp_path_factory.mktemp("replicas"), proxies=2,
                         services={"proxy": {"heartbeat_s": 0.5, "registration_ttl_s": 3}})
    local = start(config)
    redis = client_for(local.infra.redis_settings())
    proxies = Members(redis, RedisKeys(), "proxy")
    data: dict[str, Any] = {}
    try:
        data["registered"] = proxies.live(forget=False)
        served = _served_version(local)

        # A trained step whose batch had no gradient publishes no version and pauses nothing: wait for an
        # update the engine has applied (the broadcaster pauses every proxy before it updates the engine).
        def updated() -> bool:
            return _served_version(local) != served

        wait_on_stack("two trainer steps", lambda: trained_steps(local) >= 2, PROGRESS_TIMEOUT_S, local)
        wait_on_stack("an update applied on the engine", updated, PROGRESS_TIMEOUT_S, local)
        data["pauses"] = {n: _state(local, n)["pauses"] for n in ("proxy-0", "proxy-1")}
        data["requests"] = {n: _requests(local, n) for n in ("proxy-0", "proxy-1")}

        # One proxy dies: its registration lapses, the other carries the run.
        data |= kill_replica(local, "proxy-1", proxies, [local.urls["proxy-0"]], PROGRESS_TIMEOUT_S)
        data |= stop_and_read(local, allow_dead=("proxy-1",))
        data["chunks"] = read_chunks(local)
        data["urls"] = dict(local.urls)
        print(f"\nproxy replicas: pauses {data['pauses']}, calls per proxy {data['requests']}, registration lapsed "
              f"{data['lapsed_s']} s after the kill, two steps with one proxy in {data['two_steps_s']} s, "
              f"{len(data['rows'])} steps")
    finally:
        redis.close()
        local.stop()
    return data


def _served_version(local: LocalStack) -> str:
    return str(engine_info(local)["weight_version"])


def _requests(local: LocalStack, name: str) -> float:
    text = httpx.get(f"{local.urls[name]}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rein_proxy_requests_total"))


def test_replicas_register_and_every_update_pauses_both(run: dict[str, Any]) -> None:
    assert run["registered"] == sorted([run["urls"]["proxy-0"], run["urls"]["proxy-1"]])
    assert all(n >= 1 for n in run["pauses"].values()), run["pauses"]


def test_every_call_of_a_session_reaches_one_proxy(run: dict[str, Any]) -> None:
    """A call that reached the other proxy would start the session again there (its chunks' seq would
    restart at 0), and a finish there would end a session that proxy never saw (no chunks)."""
    seqs: dict[str, list[int]] = defaultdict(list)
    for chunk in run["chunks"]:
        seqs[chunk.session_id].append(chunk.seq)
    finished = {r.session_id: r.num_chunks for r in run["events"] if isinstance(r, SessionFinished)}
    assert len(finished) >= 20
    assert max(finished.values()) >= 2, "no session made two calls: affinity between calls is untested"
    wrong = {s: (n, sorted(seqs[s])) for s, n in finished.items() if sorted(seqs[s]) != list(range(n))}
    assert not wrong, f"sessions whose calls and finish did not all reach one proxy: {list(wrong.items())[:5]}"
    assert all(n > 0 for n in run["requests"].values()), f"one proxy got every session: {run['requests']}"


def test_the_run_goes_on_without_a_dead_proxy(run: dict[str, Any]) -> None:
    """Two steps after the kill were awaited in the fixture; read back, nothing was lost or trained twice."""
    assert_nothing_lost_or_trained_twice(run)
