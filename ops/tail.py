"""Read a Kafka topic back as JSON lines: the logic behind ``rein tail``.

One output line per record, ``{"topic", "partition", "offset", "timestamp_ms", "key",
"record": {...}}``; a record that does not decode becomes a line with ``"error":
"<reason>: <message>"`` in place of ``"record"`` and is counted, never raised.

Where reading starts (:class:`Start`):

- ``beginning``: the first retained offset of every partition;
- ``since``: the first offset whose timestamp is at or after a point in time
  (``offsets_for_times``; partitions with nothing that recent start at their end);
- ``offset``: one partition from one offset (only that partition is read);
- ``default``: from the beginning when not following, at the end when following
  (``tail -f``); with a consumer group, the group's committed offsets.

Without a group the consumer assigns partitions itself and commits nothing. With a
group it subscribes (partitions are split with the group's other members), applies the
start position when partitions are assigned, and commits after each batch is written.

Without ``follow`` reading stops once every partition read has reached the end offset
captured at start, so the command terminates even while producers keep writing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from shared.bus import new_client
from shared.codec import DecodeError, decode
from shared.settings import KafkaSettings

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class TailError(RuntimeError):
    """The topic cannot be read as asked (no broker, unknown topic or partition, bad start)."""


def parse_duration(text: str) -> float:
    """``"10m"`` -> 600.0 seconds; units ms, s, m, h, d, w; a bare number is seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"duration must look like 90s, 10m, 2h or 1d, got {text!r}")
    value = float(match.group(1)) * _UNIT_S[match.group(2) or "s"]
    if value <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return value


def parse_offset(text: str) -> tuple[int, int]:
    """``"2:130"`` -> (partition 2, offset 130)."""
    part, sep, off = text.partition(":")
    try:
        partition, offset = int(part), int(off)
    except ValueError:
        partition = offset = -1
    if not sep or partition < 0 or offset < 0:
        raise ValueError(f"offset must be PARTITION:OFFSET with non-negative integers, got {text!r}")
    return partition, offset


@dataclass(frozen=True)
class Start:
    """Where reading starts; build with the class methods."""

    kind: Literal["default", "beginning", "since", "offset"] = "default"
    since_ms: int = 0
    partition: int = 0
    offset: int = 0

    @classmethod
    def beginning(cls) -> Start:
        return cls("beginning")

    @classmethod
    def since(cls, seconds_ago: float, now_s: float | None = None) -> Start:
        now = time.time() if now_s is None else now_s
        return cls("since", since_ms=int((now - seconds_ago) * 1000))

    @classmethod
    def at(cls, partition: int, offset: int) -> Start:
        return cls("offset", partition=partition, offset=offset)


@dataclass(frozen=True)
class TailOptions:
    """What ``rein tail`` was asked to do."""

    topic: str
    start: Start = field(default_factory=Start)
    group_id: str | None = None
    session: str | None = None
    follow: bool = False
    max_records: int | None = None
    """Stop after printing this many lines (records and error lines)."""
    timeout_s: float | None = None
    """Bound on the whole command; None: no bound when following, :data:`DEFAULT_TIMEOUT_S` otherwise."""


DEFAULT_TIMEOUT_S = 120.0
"""A non-following tail that has not reached the captured end offsets by then gives up (exit 1)."""


@dataclass
class TailStats:
    """What one tail run read; printed on stderr at the end."""

    printed: int = 0
    filtered_out: int = 0
    decode_errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    reached_end: bool = False
    timed_out: bool = False

    def summary(self) -> str:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(self.errors_by_reason.items()))
        text = f"rein tail: {self.printed} lines printed, {self.filtered_out} filtered out, "
        text += f"{self.decode_errors} malformed records"
        if reasons:
            text += f" ({reasons})"
        if self.timed_out:
            text += "; stopped by --timeout"
        return text


def session_matches(record: dict[str, Any], session: str) -> bool:
    """True when the record belongs to ``session``.

    Matches ``session_id`` (chunks, session events), ``session_ids`` (group dispatched)
    and the ``session_id`` of each trajectory of a completed group.
    """
    if record.get("session_id") == session:
        return True
    ids = record.get("session_ids")
    if isinstance(ids, list) and session in ids:
        return True
    trajectories = record.get("trajectories")
    if isinstance(trajectories, list):
        return any(isinstance(t, dict) and t.get("session_id") == session for t in trajectories)
    return False


def render(
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int,
    key: bytes | None,
    value: bytes | None,
    max_bytes: int,
) -> tuple[dict[str, Any], DecodeError | None]:
    """One output object for one raw Kafka record, plus the decode error if it had one."""
    line: dict[str, Any] = {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "timestamp_ms": timestamp_ms,
        "key": key.decode("utf-8", errors="replace") if key is not None else None,
    }
    try:
        record = decode(value, max_bytes)
    except DecodeError as exc:
        line["error"] = str(exc)
        return line, exc
    line["record"] = record.model_dump(mode="json")
    return line, None


class _ApplyStart(ConsumerRebalanceListener):  # type: ignore[misc]
    """Group mode: seek newly assigned partitions to the start position, once each."""

    def __init__(self, tailer: Tailer) -> None:
        self._tailer = tailer
        self._started: set[TopicPartition] = set()

    def on_partitions_revoked(self, revoked: Collection[TopicPartition]) -> None:
        self._tailer.commit()

    def on_partitions_assigned(self, assigned: Collection[TopicPartition]) -> None:
        fresh = [tp for tp in assigned if tp not in self._started]
        self._started.update(fresh)
        self._tailer.seek_start(fresh)


class Tailer:
    """One ``rein tail`` run: open the consumer, read to the end (or forever), close."""

    def __init__(self, settings: KafkaSettings, options: TailOptions, write: Callable[[str], None]) -> None:
        if options.start.kind == "offset" and options.group_id is not None:
            raise TailError("--offset reads one partition by itself and cannot be combined with --group-id")
        self.settings = settings
        self.options = options
        self.stats = TailStats()
        self._write = write
        self._uncommitted: dict[TopicPartition, int] = {}
        self._consumer: KafkaConsumer | None = None

    # ------------------------------------------------------------------ consumer setup

    def _open(self) -> KafkaConsumer:
        servers = [s.strip() for s in self.settings.bootstrap_servers.split(",") if s.strip()]
        reset = "latest" if self.options.follow else "earliest"
        try:
            return new_client(lambda: KafkaConsumer(
                bootstrap_servers=servers,
                client_id=f"{self.settings.client_id}-tail",
                group_id=self.options.group_id,
                enable_auto_commit=False,
                auto_offset_reset=reset,
                request_timeout_ms=max(self.settings.request_timeout_ms, 15_000),
                max_partition_fetch_bytes=max(self.settings.max_record_bytes, 1024 * 1024),
                fetch_max_bytes=max(self.settings.max_record_bytes, 1024 * 1024) * 4,
            ))
        except KafkaError as exc:  # 3.x: KafkaTimeoutError "Unable to bootstrap"; 2.x: NoBrokersAvailable
            raise TailError(f"no Kafka broker answered at {self.settings.bootstrap_servers}: {exc}") from exc

    def _partitions(self, consumer: KafkaConsumer) -> list[TopicPartition]:
        topic = self.options.topic
        found = consumer.partitions_for_topic(topic)
        if not found:
            known = sorted(t for t in consumer.topics() if not t.startswith("__"))
            raise TailError(f"topic {topic!r} does not exist; topics on the broker: {', '.join(known) or 'none'}")
        partitions = [TopicPartition(topic, p) for p in sorted(found)]
        if self.options.start.kind == "offset":
            wanted = self.options.start.partition
            if wanted not in found:
                raise TailError(f"topic {topic!r} has partitions {sorted(found)}, not {wanted}")
            partitions = [TopicPartition(topic, wanted)]
        return partitions

    def seek_start(self, partitions: Iterable[TopicPartition]) -> None:
        """Move ``partitions`` to the start position (no-op for the default start in group mode)."""
        consumer = self._consumer
        assert consumer is not None
        parts = list(partitions)
        if not parts:
            return
        start = self.options.start
        if start.kind == "default":
            if self.options.group_id is not None:
                return  # committed offsets, or auto_offset_reset when the group has none
            if self.options.follow:
                consumer.seek_to_end(*parts)
            else:
                consumer.seek_to_beginning(*parts)
        elif start.kind == "beginning":
            consumer.seek_to_beginning(*parts)
        elif start.kind == "since":
            found = consumer.offsets_for_times({tp: start.since_ms for tp in parts})
            ends = consumer.end_offsets(parts)
            for tp in parts:
                hit = found.get(tp)
                consumer.seek(tp, hit.offset if hit is not None else ends[tp])
        else:
            beginning = consumer.beginning_offsets(parts)
            ends = consumer.end_offsets(parts)
            for tp in parts:
                if not beginning[tp] <= start.offset <= ends[tp]:
                    raise TailError(
                        f"offset {start.offset} is outside {tp.topic}/{tp.partition}'s range "
                        f"[{beginning[tp]}, {ends[tp]}]"
                    )
                consumer.seek(tp, start.offset)

    # ------------------------------------------------------------------ reading

    def commit(self) -> None:
        """Group mode: commit the next offset to read of every partition written so far."""
        if self._consumer is None or self.options.group_id is None or not self._uncommitted:
            return
        offsets = {tp: OffsetAndMetadata(o, "", -1) for tp, o in self._uncommitted.items()}
        self._consumer.commit(offsets)
        self._uncommitted.clear()

    def _emit(self, tp: TopicPartition, msg: Any) -> None:
        line, error = render(
            tp.topic, tp.partition, msg.offset, msg.timestamp, msg.key, msg.value, self.settings.max_record_bytes
        )
        self._uncommitted[tp] = msg.offset + 1
        if error is not None:
            self.stats.decode_errors += 1
            self.stats.errors_by_reason[error.reason] = self.stats.errors_by_reason.get(error.reason, 0) + 1
        elif self.options.session is not None and not session_matches(line["record"], self.options.session):
            self.stats.filtered_out += 1
            return
        self._write(json.dumps(line, ensure_ascii=False, separators=(",", ":")))
        self.stats.printed += 1

    def _at_end(self, consumer: KafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
        assigned = consumer.assignment()
        if not assigned:
            return False
        return all(consumer.position(tp) >= ends.get(tp, 0) for tp in assigned)

    def run(self) -> TailStats:
        """Read as the options say; returns the stats (also kept on ``self.stats``)."""
        opts = self.options
        timeout_s = opts.timeout_s if opts.timeout_s is not None else (None if opts.follow else DEFAULT_TIMEOUT_S)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        consumer = self._consumer = self._open()
        try:
            return self._read(consumer, deadline)
        except KafkaError as exc:
            raise TailError(f"reading {opts.topic!r} from {self.settings.bootstrap_servers} failed: {exc}") from exc
        finally:
            self._consumer = None
            consumer.close(autocommit=False)

    def _read(self, consumer: KafkaConsumer, deadline: float | None) -> TailStats:
        opts = self.options
        partitions = self._partitions(consumer)
        ends: dict[TopicPartition, int] = consumer.end_offsets(partitions)
        if opts.group_id is None:
            consumer.assign(partitions)
            self.seek_start(partitions)
        else:
            consumer.subscribe([opts.topic], listener=_ApplyStart(self))
        while True:
            if opts.max_records is not None and self.stats.printed >= opts.max_records:
                break
            if not opts.follow and opts.group_id is None and self._at_end(consumer, ends):
                self.stats.reached_end = True
                break
            if deadline is not None and time.monotonic() >= deadline:
                self.stats.timed_out = True
                break
            batches = consumer.poll(timeout_ms=200)
            for tp, messages in sorted(batches.items(), key=lambda kv: kv[0].partition):
                for msg in messages:
                    if opts.max_records is not None and self.stats.printed >= opts.max_records:
                        break
                    if not opts.follow and msg.offset >= ends.get(tp, 0):
                        continue  # written after start: past the captured end
                    self._emit(tp, msg)
            self.commit()
            # Group mode checks the end after a poll: the assignment arrives inside poll.
            if not opts.follow and opts.group_id is not None and self._at_end(consumer, ends):
                self.stats.reached_end = True
                break
        self.commit()
        return self.stats
