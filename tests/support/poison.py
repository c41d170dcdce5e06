"""Poison records for a consumer under test, and how it counts them, for the bad-input suite
(``tests/integration/test_fault_bad_input.py``).

- :func:`poison` / :func:`inject_poison`: malformed wire records of a topic's record type (garbage bytes, a
  non-map envelope, a tombstone, a wrong schema version, an unknown type, invalid fields, an oversize record),
  each with the ``rein_bus_decode_errors_total`` reason it must be counted under; :data:`INJECTED` counts
  them per topic for the printed figures.
- :func:`send`: the valid record after them, through the services' own producer; :func:`valid_group` and
  :func:`valid_manifest` build the trainer's.
- :func:`service`: the consumer as a process on a free metrics port, which must exit 0 on SIGTERM;
  :func:`scrape` / :func:`decode_errors` read its ``/metrics``.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgpack
from kafka import KafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from ops.local.ports import free_port
from shared.bus import Delivered, Producer
from shared.codec import SCHEMA_VERSION
from shared.schemas import BatchManifest, CompletedGroup, GapInfo, GroupRef, Record, Segment, Trajectory, WindowInfo
from shared.settings import KafkaSettings
from tests.support.procs import Proc, start_service

MAX_RECORD = 64 * 1024
"""REIN_KAFKA__MAX_RECORD_BYTES of the consumers under test: an oversize record is ~100 KiB."""


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as ``{(sample name, sorted labels): value}``."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    text = httpx.get(url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def decode_errors(metrics_url: str, topic: str) -> dict[str, float]:
    """``rein_bus_decode_errors_total`` of one topic, by reason."""
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in scrape(metrics_url).items()
        if name == "rein_bus_decode_errors_total" and dict(labels).get("topic") == topic
    }


def pack(obj: Any) -> bytes:
    """``obj`` as msgpack, as the services' codec writes it."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def poison(record_type: str) -> dict[str, tuple[str, bytes | None]]:
    """Malformed wire records for a topic whose records are ``record_type``: name -> (expected reason, value)."""
    return {
        "garbage": ("not_msgpack", b"\xc1\xff\x00 this is not msgpack"),
        "truncated": ("not_msgpack", pack({"schema": SCHEMA_VERSION, "type": record_type, "data": {}})[:-3]),
        "not_a_map": ("bad_envelope", pack([SCHEMA_VERSION, record_type, {}])),
        "no_data": ("bad_envelope", pack({"schema": SCHEMA_VERSION, "type": record_type})),
        "tombstone": ("empty", None),
        "schema_version": ("schema_version", pack({"schema": SCHEMA_VERSION + 98, "type": record_type, "data": {}})),
        "unknown_type": ("unknown_type", pack({"schema": SCHEMA_VERSION, "type": "no_such_record", "data": {}})),
        "invalid_fields": ("invalid_fields", pack({"schema": SCHEMA_VERSION, "type": record_type,
                                                    "data": {"index": "not a number", "bogus": [1, 2]}})),
        "oversize": ("oversize", pack({"schema": SCHEMA_VERSION, "type": record_type,
                                       "data": {"pad": "x" * (MAX_RECORD + 40_000)}})),
    }


def inject(bootstrap: str, topic: str, values: list[bytes | None], key: bytes = b"poison") -> None:
    """Produce raw values (acks=all); a larger max_request_size than the services' so oversize gets through."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=1024 * 1024)
    try:
        for value in values:
            producer.send(topic, key=key, value=value).get(timeout=30)
    finally:
        producer.close(timeout=10)


def expected_reasons(records: dict[str, tuple[str, bytes | None]]) -> dict[str, float]:
    return dict(Counter(reason for reason, _ in records.values()))


INJECTED: Counter[str] = Counter()
"""Poison records produced per topic role, for the printed figures."""


def inject_poison(bootstrap: str, topic: str, record_type: str, role: str) -> dict[str, tuple[str, bytes | None]]:
    """Every :func:`poison` record of ``record_type`` on ``topic``, counted under ``role``; the records."""
    records = poison(record_type)
    inject(bootstrap, topic, [v for _, v in records.values()])
    INJECTED[role] += len(records)
    return records


def send(bootstrap: str, topic: str, record: Record) -> Delivered:
    """One valid record, through the services' own producer."""
    producer = Producer(KafkaSettings(bootstrap_servers=bootstrap), client_suffix="fault-test")
    try:
        return producer.send(topic, record)
    finally:
        producer.close()


@contextmanager
def service(name: str, module: str, bootstrap: str, env: dict[str, str], log_dir: Path, *,
            start_timeout_s: float = 60, stop_timeout_s: float = 20) -> Iterator[tuple[Proc, str]]:
    """``python -m module`` with ``env`` on a free metrics port, reading Kafka at ``bootstrap`` with records
    capped at :data:`MAX_RECORD` (so an oversized poison record is refused), logging warnings: (the process,
    its base URL). Stopped on the way out by SIGTERM, after which it must have exited 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    common = {"REIN_KAFKA__BOOTSTRAP_SERVERS": bootstrap, "REIN_KAFKA__MAX_RECORD_BYTES": str(MAX_RECORD),
              "REIN_LOG_LEVEL": "warning", "REIN_METRICS_PORT": str(port)}
    proc = start_service(module, {**env, **common}, f"{url}/health", timeout_s=start_timeout_s, log_dir=log_dir)
    try:
        yield proc, url
    finally:
        code = proc.stop(timeout_s=stop_timeout_s)
    assert code == 0, f"{name} exited {code} on SIGTERM; log:\n{proc.tail()}"


def valid_group(group_id: str) -> CompletedGroup:
    """A group of two trajectories (rewards 1 and 0) on ``v0``: a trainer can train it."""
    trajs = [
        Trajectory(
            session_id=f"{group_id}-s{k}", status="completed", reward=reward,
            segments=[Segment(segment_index=0, token_ids=[3 + (k + j) % 20 for j in range(10)],
                              loss_mask=[0] * 4 + [1] * 6, logprobs=[0.0] * 4 + [-2.0] * 6,
                              versions=[None] * 4 + ["v0"] * 6)],
        )
        for k, reward in enumerate([1.0, 0.0])
    ]
    return CompletedGroup(group_id=group_id, prompt_id=f"p-{group_id}", failed=False, trajectories=trajs)


def valid_manifest(index: int, refs: list[GroupRef]) -> BatchManifest:
    """Manifest ``index`` of the groups ``refs`` points at, in a window on ``v0``."""
    return BatchManifest(batch_id=f"b{index}-{uuid.uuid4().hex[:6]}", index=index, groups=refs,
                         window=WindowInfo(keep_versions=2, current_version="v0", current_index=0, cutoff_index=0),
                         version_gap=GapInfo(min=0, max=0, mean=0.0), drops_in_batch=0, drops_cumulative=0)
