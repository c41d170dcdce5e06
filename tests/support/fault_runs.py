"""What the e2e runs that break the local stack mid-run share, on top of ``readback``: how long they wait for
training to move on, the wait showing that it moved on past a fault, and the checks they end with.

Used by ``tests/e2e``: ``test_faults``, ``test_kafka_cluster``, ``test_redis_failover``, ``test_engine_replicas``
and ``test_proxy_replicas``.
"""

from __future__ import annotations

from typing import Any

import httpx

from ops.local.stack import LocalStack
from shared.bus import read_topic
from shared.schemas import Chunk, WeightPublished
from shared.settings import KafkaSettings
from tests.support.readback import assert_every_manifest_trained_once, assert_groups_accounted_for, trained_index
from tests.support.wait import wait_on_stack

PROGRESS_TIMEOUT_S = 300
"""How long a run may take to make progress (a trainer step, a batch trained) on a loaded machine."""


def wait_trained(local: LocalStack, index: int, what: str) -> None:
    """Wait until manifest ``index`` is trained (``what``: which batch that is). With ``index`` read from
    ``batches_made`` at a fault, that batch was made after it: a batch made before could still train."""
    wait_on_stack(f"{what} trained", lambda: trained_index(local) >= index, PROGRESS_TIMEOUT_S, local)


def proxy_state(local: LocalStack, name: str) -> dict[str, Any]:
    """Proxy ``name``'s ``/v1/rollout/state`` (pauses, live sessions, engines), read with the admin token."""
    answer = httpx.get(f"{local.urls[name]}/v1/rollout/state", timeout=5,
                       headers={"Authorization": f"Bearer {local.credentials.admin_token}"})
    answer.raise_for_status()
    state: dict[str, Any] = answer.json()
    return state


def read_chunks(local: LocalStack) -> list[Chunk]:
    """Every chunk the run published: which engine served each call, in order within a session."""
    kafka = KafkaSettings(bootstrap_servers=local.infra.kafka_bootstrap)
    return [r for r in read_topic(kafka, local.config.topics.chunks, 60) if isinstance(r, Chunk)]


def assert_nothing_lost_or_trained_twice(run: dict[str, Any]) -> None:
    """A run read back by ``stop_and_read``: every manifest trained once, every kept group trained or pending."""
    assert_every_manifest_trained_once(run["rows"])
    assert_groups_accounted_for(run["batches"], run["decisions"], run["pending"])


def assert_registry_matches_weights(run: dict[str, Any]) -> None:
    """The version registry in Redis lists every version on the ``weights`` topic, at its seq, and no other."""
    published = {r.version: r.seq for r in run["weights"] if isinstance(r, WeightPublished)}
    registry = {label: int(seq) for label, seq in run["registry"]}
    assert registry == published, "the registry in Redis differs from the weights topic"
