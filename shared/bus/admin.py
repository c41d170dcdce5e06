"""The bus's admin side: topics created as :mod:`shared.topology` says, and their configuration read back."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import TopicAlreadyExistsError

from shared.bus.client import BusUnavailable, connect, servers
from shared.names import Topics
from shared.settings import KafkaSettings
from shared.topology import topic_specs


def create_topics(
    admin: KafkaAdminClient,
    partitions: dict[str, int],
    configs: Mapping[str, Mapping[str, str]] | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create the missing topics and wait until every partition has a leader.

    Replication is the brokers' ``default.replication.factor`` (and ``min.insync.replicas``): 1 on one
    node, 3 and 2 on the three-node cluster ``deploy/kafka.sh start DIR --brokers 3`` starts; with the
    producers' ``acks=all`` a write then survives the loss of one broker.

    ``configs`` maps a topic name to its topic configuration. Returns the names this call
    created. Waiting matters: a producer or an assigned consumer that races a fresh topic's
    leader election sees errors or stalls.
    """
    existing = set(admin.list_topics())
    created: list[str] = []
    for name, count in partitions.items():
        if name in existing:
            continue
        config = dict((configs or {}).get(name, {}))
        try:
            admin.create_topics(
                [NewTopic(name, count, -1, topic_configs=config)],  # -1: the brokers' default
                timeout_ms=int(timeout_s * 1000),
            )
            created.append(name)
        except TopicAlreadyExistsError:
            pass
    deadline = time.monotonic() + timeout_s
    # A topic that already existed keeps its own partition count; only new ones must reach theirs.
    waiting = {name: (count if name in created else 1) for name, count in partitions.items()}
    while waiting:
        for meta in admin.describe_topics(list(waiting)):
            parts = meta.get("partitions") or []
            if meta.get("error_code", 0) == 0 and len(parts) >= waiting.get(meta["topic"], 1) and all(
                p.get("leader", -1) >= 0 for p in parts
            ):
                waiting.pop(meta["topic"], None)
        if waiting:
            if time.monotonic() > deadline:
                raise BusUnavailable(f"topics {sorted(waiting)} have no leader after {timeout_s}s")
            time.sleep(0.1)
    return created


def admin_client(settings: KafkaSettings) -> KafkaAdminClient:
    """An admin client on the configured brokers (bounded connection attempts)."""
    client: KafkaAdminClient = connect(
        lambda: KafkaAdminClient(
            bootstrap_servers=servers(settings),
            client_id=f"{settings.client_id}-admin",
            request_timeout_ms=settings.request_timeout_ms,
        ),
        "admin",
        settings,
    )
    return client


def ensure_topology(
    settings: KafkaSettings, topics: Topics, partitions: int = 4, only: Iterable[str] | None = None
) -> list[str]:
    """Create the missing topics of ``topics`` as :func:`shared.topology.topic_specs` says (all, or
    ``only`` those names) and wait for their leaders; returns the ones created."""
    specs = topic_specs(topics, partitions)
    names = list(specs) if only is None else list(only)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"not rein topics: {unknown}")
    admin = admin_client(settings)
    try:
        return create_topics(
            admin, {n: specs[n].partitions for n in names}, {n: specs[n].configs for n in names}
        )
    finally:
        admin.close()


def topic_configs(settings: KafkaSettings, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """Each topic's effective configuration on the broker (its own and the broker's defaults)."""
    admin = admin_client(settings)
    try:
        wanted = list(names)
        responses = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in wanted])
    finally:
        admin.close()
    out: dict[str, dict[str, str]] = {}
    for response in responses:
        for error_code, error_message, _type, name, entries in (r[:5] for r in response.resources):
            if error_code:
                raise BusUnavailable(f"describing topic {name!r} failed: error {error_code} {error_message}")
            out[name] = {entry[0]: entry[1] for entry in entries if entry[1] is not None}
    missing = [n for n in wanted if n not in out]
    if missing:
        raise BusUnavailable(f"the broker described no configuration for topics {missing}")
    return out
