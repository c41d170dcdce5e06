"""The msgpack wire form of every record, and the checks a consumer's decode makes.

Wire form: a msgpack map ``{"schema": SCHEMA_VERSION, "type": <record type>,
"data": {...fields}}``. :func:`decode` checks size, envelope, schema version and
fields, and raises :class:`DecodeError` naming the problem; consumers count,
log and skip such records (STYLE 7) instead of crashing.
"""

from __future__ import annotations

from typing import Annotated

import msgpack
from pydantic import Field, TypeAdapter, ValidationError

from shared.schemas import (
    BatchManifest,
    BatchSkipped,
    Chunk,
    CompletedGroup,
    DecisionRecord,
    GroupDispatched,
    Record,
    RetryRequest,
    SessionFinished,
    SessionRejected,
    WeightApplied,
    WeightPublished,
)

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 16 * 1024 * 1024


AnyRecord = Annotated[
    Chunk
    | GroupDispatched
    | SessionFinished
    | SessionRejected
    | CompletedGroup
    | DecisionRecord
    | BatchManifest
    | WeightPublished
    | WeightApplied
    | BatchSkipped
    | RetryRequest,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[AnyRecord] = TypeAdapter(AnyRecord)
RECORD_TYPES: dict[str, type[Record]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        Chunk,
        GroupDispatched,
        SessionFinished,
        SessionRejected,
        CompletedGroup,
        DecisionRecord,
        BatchManifest,
        WeightPublished,
        WeightApplied,
        BatchSkipped,
        RetryRequest,
    )
}


class DecodeError(ValueError):
    """A record could not be decoded; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def encode(record: Record) -> bytes:
    """The msgpack envelope of ``record``."""
    data = record.model_dump(mode="json", exclude={"type"})
    packed: bytes = msgpack.packb({"schema": SCHEMA_VERSION, "type": record.type, "data": data}, use_bin_type=True)
    return packed


def decode(raw: bytes | None, max_bytes: int = DEFAULT_MAX_BYTES) -> Record:
    """Decode one wire record or raise DecodeError naming what is wrong."""
    if raw is None:
        raise DecodeError("empty", "record has no value (tombstone)")
    if len(raw) > max_bytes:
        raise DecodeError("oversize", f"record is {len(raw)} bytes, limit is {max_bytes}")
    try:
        envelope = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise DecodeError("not_msgpack", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(envelope, dict):
        raise DecodeError("bad_envelope", f"expected a map envelope, got {type(envelope).__name__}")
    missing = [k for k in ("schema", "type", "data") if k not in envelope]
    if missing:
        raise DecodeError("bad_envelope", f"envelope lacks {', '.join(missing)}")
    if envelope["schema"] != SCHEMA_VERSION:
        raise DecodeError("schema_version", f"schema {envelope['schema']!r}, this build reads {SCHEMA_VERSION}")
    kind = envelope["type"]
    if kind not in RECORD_TYPES:
        raise DecodeError("unknown_type", f"record type {kind!r} is not one of {sorted(RECORD_TYPES)}")
    data = envelope["data"]
    if not isinstance(data, dict):
        raise DecodeError("bad_envelope", f"data must be a map, got {type(data).__name__}")
    try:
        record: Record = _ADAPTER.validate_python({**data, "type": kind})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:]) or '<record>'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise DecodeError("invalid_fields", f"{kind}: {problems}") from None
    return record
