"""Fetch the groups a manifest references from ``rollout.groups`` (Kafka adapter).

One long-lived, group-less consumer is assigned the partitions a manifest needs,
seeks to each wanted offset and polls until every reference is found. This is
``shared.bus.read_at`` for many references at once, without a new broker
connection per group.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from kafka import TopicPartition

from shared import log
from shared.bus import Consumer
from shared.codec import DecodeError, decode
from shared.schemas import CompletedGroup, GroupRef
from shared.settings import KafkaSettings

_log = log.get(__name__)


class FetchTimeout(RuntimeError):
    """Referenced groups were not found on the groups topic within the bound."""


@dataclass
class Fetched:
    groups: list[CompletedGroup] = field(default_factory=list)
    """Found groups, in the manifest's order."""
    bad: list[tuple[GroupRef, str]] = field(default_factory=list)
    """References that could not be used (undecodable record, wrong type or group id), with the reason."""


class GroupFetcher:
    def __init__(self, settings: KafkaSettings, topic: str) -> None:
        self._settings = settings
        self._topic = topic
        self._consumer = Consumer(settings, [], None, client_suffix="trainer-fetch", from_beginning=True)

    def fetch(self, refs: list[GroupRef], timeout_s: float) -> Fetched:
        raw = self._consumer.raw
        wanted: dict[int, set[int]] = defaultdict(set)
        for ref in refs:
            wanted[ref.partition].add(ref.offset)
        tps = {p: TopicPartition(self._topic, p) for p in wanted}
        raw.assign(list(tps.values()))
        for p, offsets in wanted.items():
            raw.seek(tps[p], min(offsets))
        found: dict[tuple[int, int], bytes | None] = {}
        deadline = time.monotonic() + timeout_s
        while any(wanted.values()):
            if time.monotonic() > deadline:
                missing = sorted((p, o) for p, offs in wanted.items() for o in offs)
                raise FetchTimeout(f"groups at {self._topic} {missing} not found within {timeout_s}s")
            for tp, messages in raw.poll(timeout_ms=500).items():
                left = wanted[tp.partition]
                for msg in messages:
                    if msg.offset in left:
                        found[(tp.partition, msg.offset)] = msg.value
                        left.discard(msg.offset)
                if left and messages and min(left) > messages[-1].offset + 1:
                    raw.seek(tp, min(left))  # skip records of other batches in between
                elif not left:
                    raw.pause(tp)
        raw.resume(*tps.values())
        out = Fetched()
        for ref in refs:
            try:
                record = decode(found[(ref.partition, ref.offset)], self._settings.max_record_bytes)
            except DecodeError as exc:
                out.bad.append((ref, exc.reason))
                continue
            if not isinstance(record, CompletedGroup) or record.group_id != ref.group_id:
                out.bad.append((ref, "wrong_record"))
                continue
            out.groups.append(record)
        for ref, reason in out.bad:
            _log.warning("group_ref_unusable", group_id=ref.group_id, partition=ref.partition, offset=ref.offset,
                         reason=reason)
        return out

    def close(self) -> None:
        self._consumer.close()
