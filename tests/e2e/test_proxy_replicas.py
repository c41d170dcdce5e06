"""Two proxy replicas behind HAProxy: sessions stay on one proxy, every update pauses both, and the run
goes on when one dies (its registration lapses; a newcomer joining a pause is in
``tests/integration/proxy/test_membership.py``).

The local stack with ``proxies=2``: each proxy registers itself in Redis (``REIN_ADVERTISE_URL``), the
broadcaster has no ``REIN_PROXY_URLS`` and finds them there, and ``deploy/haproxy.sh`` balances agents'
calls by session (a key in the path, else ``X-Session-Id``, else the API key). The rollout runner
(multi-call sessions, then a finish) reaches the proxies through HAProxy only.
"""

from __future__ import annotations

import signal
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ops.local.stack import LocalStack, SharedInfra, start
from shared.errors import SESSION_LOST
from shared.membership import Members
from shared.schemas import SessionFinished, SessionRejected
from shared.state import client_for
from tests.support.fault_runs import (
    PROGRESS_TIMEOUT_S,
    assert_nothing_lost_or_trained_twice,
    proxy_state,
    read_chunks,
)
from tests.support.readback import engine_info, kill_replica, small_stack, stop_and_read, trained_steps
from tests.support.wait import wait_on_stack

_FAILED_FOR_THE_KILL = frozenset({"session_lost", "session_interrupted", "session_moved", "session_idle",
                                  "session_not_found", "incomplete"})
"""What a session the dead proxy held between calls must not end with (it was continued instead)..."""
_CALL_ON_THE_WIRE = frozenset({"unreachable", "timeout", "http_502", "http_503", "http_504"})
"""...unless its agent's call was on the wire to the dead proxy: what the agent saw then."""

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, stack_infra: Callable[[str], SharedInfra]) -> dict[str, Any]:
    config = small_stack(tmp_path_factory.mktemp("replicas"), proxies=2, shared_infra=stack_infra("replicas"),
                         services={"proxy": {"heartbeat_s": 0.5, "registration_ttl_s": 3},
                                   # each agent step waits as a tool would: sessions spend most of their time
                                   # between calls, where a dead proxy's sessions are continued by the other
                                   "rollout": {"env_time_median_s": 0.2}})
    local = start(config)
    redis = client_for(local.infra.redis_settings())
    proxies = Members(redis, local.config.redis_keys, "proxy")
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
        data["pauses"] = {n: proxy_state(local, n)["pauses"] for n in ("proxy-0", "proxy-1")}
        data["requests"] = {n: _requests(local, n) for n in ("proxy-0", "proxy-1")}

        # One proxy dies: its registration lapses, the other carries the run and continues its sessions. It
        # dies while it holds sessions between calls (not in the middle of an update's pause, which holds
        # every call in flight).
        held = _frozen_holding_sessions(local, redis, "proxy-1")
        data |= kill_replica(local, "proxy-1", proxies, [local.urls["proxy-0"]], PROGRESS_TIMEOUT_S,
                             at_kill=lambda: held)
        data["takeovers"] = _metric(local, "proxy-0", "rein_proxy_session_takeovers_total")
        data |= stop_and_read(local, allow_dead=("proxy-1",))
        data["chunks"] = read_chunks(local)
        data["urls"] = dict(local.urls)
        print(f"\nproxy replicas: pauses {data['pauses']}, calls per proxy {data['requests']}, registration lapsed "
              f"{data['lapsed_s']} s after the kill, two steps with one proxy in {data['two_steps_s']} s, "
              f"{len(data['rows'])} steps; at the kill the dead proxy held {_held(data)}; proxy-0's takeovers "
              f"{data['takeovers']}; sessions of the dead proxy that did not finish, by why: {_unfinished(data)}")
    finally:
        redis.close()
        local.stop()
    return data


def _frozen_holding_sessions(local: LocalStack, redis: Any, name: str) -> dict[str, str]:
    """Stop replica ``name`` (SIGSTOP) at a moment it holds sessions between calls, and return the sessions it
    holds (:func:`_sessions_of`): frozen, it changes none of them until it is killed, so they are what it held at
    its death. Read while it runs, its sessions could all end in the moments before the kill (a wave's last
    finishes, with the pacing holding the next prompts back for a step)."""
    proc = next(s for s in local.stack.services if s.name == name).proc
    assert proc is not None

    held: dict[str, str] = {}

    def frozen_holding() -> bool:
        if list(_sessions_of(local, redis, local.urls[name]).values()).count("between") < 3:
            return False
        proc.send_signal(signal.SIGSTOP)
        held.update(_sessions_of(local, redis, local.urls[name]))
        if "between" in held.values():
            return True
        held.clear()
        proc.send_signal(signal.SIGCONT)
        return False

    wait_on_stack(f"{name} holding sessions between calls", frozen_holding, PROGRESS_TIMEOUT_S, local)
    return held


def _served_version(local: LocalStack) -> str:
    return str(engine_info(local)["weight_version"])


def _requests(local: LocalStack, name: str) -> float:
    return sum(_metric(local, name, "rein_proxy_requests_total").values())


def _metric(local: LocalStack, name: str, series: str) -> dict[str, float]:
    """Each sample of ``series`` on replica ``name``, by its labels."""
    text = httpx.get(f"{local.urls[name]}/metrics", timeout=5).text
    return {line.rsplit(" ", 1)[0].removeprefix(series): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(series)}


def _sessions_of(local: LocalStack, redis: Any, url: str) -> dict[str, str]:
    """The sessions the proxy at ``url`` holds (its handoff hashes, all read in one round trip: the read is
    short while the proxy is frozen): ``between`` calls (every chunk in its snapshot; or already taken over
    from it) or ``in_call``."""
    keys = list(redis.scan_iter(match=f"{local.config.redis_keys.session('')}*", count=10_000))
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        pipe.hmget(key, "taken_from", "owner", "end", "calls", "saved")
    held = {}
    for key, (taken_from, owner, end, calls, saved) in zip(keys, pipe.execute(), strict=True):
        if str(taken_from or "").startswith(f"{url}#"):
            held[key.rsplit(":", 1)[1]] = "between"
        elif str(owner or "").startswith(f"{url}#") and end is None:
            held[key.rsplit(":", 1)[1]] = "between" if calls == saved else "in_call"
    return held


def _held(data: dict[str, Any]) -> dict[str, int]:
    return dict(Counter(data["at_kill"].values()))


def _unfinished(data: dict[str, Any]) -> dict[str, int]:
    """Why the dead proxy's sessions that did not finish ended: ``in_call``/``between`` at the kill, then the
    error (a lost session's says what its agent saw)."""
    held, out = data["at_kill"], Counter[str]()
    for r in data["events"]:
        if isinstance(r, SessionRejected) and r.session_id in held:
            why = r.detail.get("error", "") if r.error == SESSION_LOST else r.error
            out[f"{held[r.session_id]}: {r.error} ({why})"] += 1
    return dict(out)


def test_replicas_register_and_every_update_pauses_both(run: dict[str, Any]) -> None:
    assert run["registered"] == sorted([run["urls"]["proxy-0"], run["urls"]["proxy-1"]])
    assert all(n >= 1 for n in run["pauses"].values()), run["pauses"]


def test_every_call_of_a_session_reaches_one_proxy(run: dict[str, Any]) -> None:
    """While both proxies live, every call of a session reaches one of them; after the kill, the dead one's
    sessions go on at the other from their snapshots. Either way a session's chunks are numbered 0, 1, 2, ...
    (a call that reached a proxy that did not know the session would restart them at 0) and its finish
    counts them all."""
    seqs: dict[str, list[int]] = defaultdict(list)
    for chunk in run["chunks"]:
        seqs[chunk.session_id].append(chunk.seq)
    finished = {r.session_id: r.num_chunks for r in run["events"] if isinstance(r, SessionFinished)}
    assert len(finished) >= 20
    assert max(finished.values()) >= 2, "no session made two calls: affinity between calls is untested"
    wrong = {s: (n, sorted(seqs[s])) for s, n in finished.items() if sorted(seqs[s]) != list(range(n))}
    assert not wrong, f"sessions whose calls and finish did not all reach one proxy: {list(wrong.items())[:5]}"
    assert all(n > 0 for n in run["requests"].values()), f"one proxy got every session: {run['requests']}"


def test_the_dead_proxys_sessions_go_on_but_those_in_a_call(run: dict[str, Any]) -> None:
    """Sessions the dead proxy held between calls are continued by the other: none is refused there (each
    finishes, or a staleness rule rejects it). Only a session with a call in flight may be lost: one begun on
    the dead proxy, or one whose request reached it and was not begun yet (its agent saw the connection
    drop, as the balancer answers it: 502)."""
    held = run["at_kill"]
    assert held, "the dead proxy held no session: the handoff is untested"
    between = {sid for sid, state in held.items() if state == "between"}
    refused = {r.session_id: (r.error, r.detail) for r in run["events"] if isinstance(r, SessionRejected)
               and r.session_id in between and r.error in _FAILED_FOR_THE_KILL
               and not (r.error == SESSION_LOST and r.detail.get("error") in _CALL_ON_THE_WIRE)}
    assert not refused, f"sessions held between calls that were not continued: {refused}"
    continued = run["takeovers"].get('{outcome="continued"}', 0)
    finished = {r.session_id for r in run["events"] if isinstance(r, SessionFinished)}
    assert continued >= len(between & finished) >= 1, (continued, between, _unfinished(run))


def test_the_run_goes_on_without_a_dead_proxy(run: dict[str, Any]) -> None:
    """Two steps after the kill were awaited in the fixture; read back, nothing was lost or trained twice."""
    assert_nothing_lost_or_trained_twice(run)
