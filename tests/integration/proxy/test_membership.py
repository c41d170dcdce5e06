"""A proxy replica's registration in Redis: it joins a pause in progress before it serves, registers,
leaves when stopped and lapses when killed. Real proxy processes, real Redis and Kafka; the engine URL
is a closed port (nothing here generates)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from ops.local.ports import free_port
from shared.membership import Members
from shared.names import RedisKeys, Topics
from shared.pause_record import PauseRecord
from shared.settings import RedisSettings
from shared.state import connect
from tests.support.procs import ServiceStartError
from tests.support.stack import proxy_process
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration]

ADMIN = "membership-admin-token"


def test_a_replica_joins_the_held_pause_registers_and_leaves(
    kafka_bootstrap: str, unique_topic: Callable[..., str], redis_db_url: str, tmp_path: Path
) -> None:
    topics = Topics(chunks=unique_topic(), events=unique_topic())
    prefix = f"m{uuid.uuid4().hex[:8]}"
    client = connect(RedisSettings(url=redis_db_url))
    keys = RedisKeys(prefix)
    members, pauses = Members(client, keys, "proxy"), PauseRecord(client, keys)
    env = {"REIN_REDIS__URL": redis_db_url, "REIN_REDIS__KEY_PREFIX": prefix, "REIN_HEARTBEAT_S": "0.2",
           "REIN_REGISTRATION_TTL_S": "1.5"}
    try:
        pauses.hold("pause-7", "weights v7", 30.0)  # a broadcaster is mid-update
        with proxy_process([f"http://127.0.0.1:{free_port()}"], kafka_bootstrap, topics, tmp_path, admin_token=ADMIN,
                           extra_env={**env, "REIN_ADVERTISE_URL": "http://replica-a:8000"}) as proxy:
            auth = {"Authorization": f"Bearer {ADMIN}"}
            state = httpx.get(f"{proxy.url}/v1/rollout/state", headers=auth, timeout=10).json()
            assert state["paused"] and state["pause_id"] == "pause-7", state
            assert 0 < state["lease_left_s"] <= 30
            assert members.live() == ["http://replica-a:8000"]
            # The broadcaster ends its pause on every registered proxy: this one included.
            pauses.end("pause-7")
            resumed = httpx.post(f"{proxy.url}/v1/rollout/resume", headers=auth, json={"pause_id": "pause-7"},
                                 timeout=10)
            assert resumed.status_code == 200, resumed.text
            assert not httpx.get(f"{proxy.url}/v1/rollout/state", headers=auth, timeout=10).json()["paused"]
        assert members.live() == [], "a proxy stopped cleanly leaves at once"

        assert pauses.current() is None
        with proxy_process([f"http://127.0.0.1:{free_port()}"], kafka_bootstrap, topics, tmp_path, admin_token=ADMIN,
                           extra_env={**env, "REIN_ADVERTISE_URL": "http://replica-b:8000"}) as proxy:
            state = httpx.get(f"{proxy.url}/v1/rollout/state", headers={"Authorization": f"Bearer {ADMIN}"},
                              timeout=10).json()
            assert not state["paused"], "no pause held: the proxy starts serving"
            # Renewed well past its 1.5 s lifetime while it lives.
            wait_until(lambda: members.live() == ["http://replica-b:8000"], 5, "the registration")
            assert proxy.proc.proc is not None
            proxy.proc.proc.kill()
            proxy.proc.proc.wait(timeout=30)
            wait_until(lambda: members.live() == [], 5, "a killed proxy's registration to lapse")
    finally:
        client.close()


def test_a_replica_that_cannot_reach_redis_does_not_start(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """Registration is promised by REIN_ADVERTISE_URL: without Redis the proxy fails at start, saying why,
    instead of serving while no broadcaster can find it to pause it."""
    topics = Topics(chunks=unique_topic(), events=unique_topic())
    env = {"REIN_REDIS__URL": f"redis://127.0.0.1:{free_port()}/0", "REIN_REDIS__SOCKET_TIMEOUT_S": "0.5",
           "REIN_ADVERTISE_URL": "http://replica-c:8000"}
    with pytest.raises(ServiceStartError, match="did not answer"), proxy_process(
            [f"http://127.0.0.1:{free_port()}"], kafka_bootstrap, topics, tmp_path, admin_token=ADMIN, extra_env=env):
        pass
