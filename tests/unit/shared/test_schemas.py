from __future__ import annotations

import contextlib
import os
import time

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import schemas
from shared.codec import SCHEMA_VERSION, DecodeError, decode, encode
from shared.schemas import (
    BatchManifest,
    BatchSkipped,
    Chunk,
    CompletedGroup,
    DecisionRecord,
    GroupRef,
    SamplingParams,
    Segment,
    Trajectory,
    WeightApplied,
    WeightPublished,
    WindowInfo,
)


def _chunk(**kw: object) -> Chunk:
    base: dict[str, object] = dict(
        session_id="s", group_id="g", seq=0, segment_index=0, chunk_index=0, finish_reason="stop"
    )
    base.update(kw)
    return Chunk.model_validate(base)


def test_round_trip_keeps_every_field() -> None:
    c = _chunk(output_ids=[4, 5], logprobs=[-0.5, -1.0], version="v3", context_ids=[1, 2])
    assert decode(encode(c)) == c


def test_manifest_round_trip() -> None:
    m = BatchManifest(
        batch_id="b-1",
        index=0,
        groups=[GroupRef(group_id="g", partition=1, offset=7)],
        window=WindowInfo(keep_versions=2, current_version="v3", current_index=3, cutoff_index=2),
        version_gap=None,
        drops_in_batch=0,
        drops_cumulative=4,
    )
    assert decode(encode(m)) == m
    assert m.key() == "b-1"



def test_a_manifest_from_before_tokens_were_counted_decodes_with_zero() -> None:
    m = BatchManifest(
        batch_id="b-2", index=1, groups=[GroupRef(group_id="g", partition=0, offset=1)],
        window=WindowInfo(keep_versions=2, current_version="v3", current_index=3, cutoff_index=2),
        version_gap=None, drops_in_batch=0, drops_cumulative=0,
        generated_tokens_cumulative=90, untrained_tokens_cumulative={"window": 12, "no_signal": 0, "failed": 3},
    )
    assert decode(encode(m)) == m
    env = msgpack.unpackb(encode(m))
    del env["data"]["generated_tokens_cumulative"], env["data"]["untrained_tokens_cumulative"]
    old = decode(msgpack.packb(env))
    assert isinstance(old, BatchManifest)
    assert (old.generated_tokens_cumulative, old.untrained_tokens_cumulative) == (0, {})


def test_batch_skipped_round_trips_and_keeps_one_key_on_the_compacted_weights_topic() -> None:
    """Readers want the highest skipped index only, so compaction may drop every older skip, never a version."""
    skip = BatchSkipped(index=7, batch_id="b-7", reason="no_signal", version="v3 ")
    assert decode(encode(skip)) == skip and skip.version == "v3"
    assert skip.key() == BatchSkipped(index=8, batch_id="b-8", reason="no_tokens", version="v3").key()
    assert skip.key() not in {"v3", WeightApplied(version="v3", seq=3, digest="d").key()}
    assert skip.topic_attr == WeightPublished.topic_attr


def test_each_record_has_its_own_timestamp() -> None:
    """``ts`` is the wall clock when the record is made: not an import-time value, not shared."""
    before = time.time()
    a = WeightPublished(version="v1", seq=1, path="p", digest="d", step=1)
    while time.time() <= a.ts:  # the clock moves on within microseconds; no sleep needed
        pass
    b = WeightPublished(version="v1", seq=1, path="p", digest="d", step=1)
    after = time.time()
    assert before <= a.ts < b.ts <= after


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xc1\xc1", "not_msgpack"),
        (msgpack.packb([1, 2]), "bad_envelope"),
        (msgpack.packb({"schema": 1, "type": "chunk"}), "bad_envelope"),
        (msgpack.packb({"schema": 99, "type": "chunk", "data": {}}), "schema_version"),
        (msgpack.packb({"schema": 1, "type": "nope", "data": {}}), "unknown_type"),
        (msgpack.packb({"schema": 1, "type": "chunk", "data": []}), "bad_envelope"),
        (None, "empty"),
    ],
)
def test_malformed_records_name_the_problem(raw: bytes | None, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(raw)
    assert info.value.reason == reason


def test_invalid_fields_are_named() -> None:
    raw = msgpack.packb({"schema": 1, "type": "chunk", "data": {"session_id": "s", "group_id": "g", "seq": -1}})
    with pytest.raises(DecodeError, match=r"seq: .*greater than or equal") as info:
        decode(raw)
    assert info.value.reason == "invalid_fields"


def test_unknown_fields_are_rejected() -> None:
    data = encode(_chunk())
    env = msgpack.unpackb(data)
    env["data"]["surprise"] = 1
    with pytest.raises(DecodeError, match="surprise"):
        decode(msgpack.packb(env))


def test_oversize_is_rejected_before_parsing() -> None:
    with pytest.raises(DecodeError) as info:
        decode(encode(_chunk(output_ids=list(range(1000)))), max_bytes=100)
    assert info.value.reason == "oversize"


@given(st.binary(max_size=200))
def test_garbage_never_raises_anything_but_decode_error(raw: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode(raw)


def test_ids_are_never_prefixes_of_each_other() -> None:
    """SGLang matches rids by prefix. Ids with a counter (``rid-1`` / ``rid-10``), an unpadded random
    number or a prefix that extends another (``rid`` / ``rid-1``) would fail here."""
    ids = [schemas.new_id(prefix) for prefix in ("rid", "rid-1", "r") for _ in range(100)]
    assert len(set(ids)) == len(ids)
    assert not any(a != b and b.startswith(a) for a in ids for b in ids)


def test_a_forked_child_draws_ids_of_its_own() -> None:
    """Services forked from one warm server (ops/local/warm.py) must not repeat each other's group ids."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id to the parent, then out without pytest's exit handlers
        os.write(write, schemas.new_id("g").encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child.startswith("g-") and child != schemas.new_id("g")


def test_chunk_carries_per_token_versions_across_the_wire() -> None:
    chunk = _chunk(output_ids=[5, 6, 7], logprobs=[-1.0] * 3, version="v2", token_versions=[("v1", 1), ("v2", 2)])
    back = decode(encode(chunk))
    assert isinstance(back, Chunk) and back == chunk
    assert back.output_versions() == ["v1", "v2", "v2"]
    assert _chunk(output_ids=[5, 6], version="v3").output_versions() == ["v3", "v3"]  # no runs: one label


def test_sampling_parameters_cross_the_wire_on_chunks_and_segments() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40)
    chunk = _chunk(output_ids=[5, 6], logprobs=[-1.0] * 2, sampling=params)
    back = decode(encode(chunk))
    assert isinstance(back, Chunk) and back.sampling == params
    seg = Segment(segment_index=0, token_ids=[1, 5, 6], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
                  versions=[None, "v1", "v1"], sampling=[(None, 1), (params, 2)])
    group = CompletedGroup(group_id="g", prompt_id="p", failed=False,
                           trajectories=[Trajectory(session_id="s", status="completed", segments=[seg])])
    again = decode(encode(group))
    assert isinstance(again, CompletedGroup)
    assert again.trajectories[0].segments[0].token_sampling() == [None, params, params]
    with pytest.raises(ValueError, match="sampling runs cover 2 tokens"):
        Segment(segment_index=0, token_ids=[1, 5, 6], loss_mask=[0, 1, 1], logprobs=[0.0] * 3,
                versions=[None] * 3, sampling=[(params, 2)])


@pytest.mark.parametrize("runs", [[("v1", 2)], [("v1", 1), ("v2", 1), ("v3", 1), ("v1", 1)], [("v1", 3), ("v2", 0)]])
def test_chunk_version_runs_must_cover_the_output_exactly(runs: list[tuple[str, int]]) -> None:
    with pytest.raises(ValueError, match="token_versions cover"):
        _chunk(output_ids=[5, 6, 7], token_versions=runs)


# --------------------------------------------------------------------------- labels enter normalised


def _wire(kind: str, data: dict[str, object]) -> bytes:
    """A record as another producer might write it: the envelope only, no schema on the way out."""
    packed: bytes = msgpack.packb({"schema": SCHEMA_VERSION, "type": kind, "data": data})
    return packed


NOT_REAL = [None, "", "  ", "-1", " -1 ", "unknown", " UNKNOWN ", "none", "None"]


@pytest.mark.parametrize("raw_label", NOT_REAL)
def test_a_raw_label_in_a_chunk_decodes_to_none(raw_label: str | None) -> None:
    data = {"session_id": "s", "group_id": "g", "seq": 0, "segment_index": 0, "chunk_index": 0,
            "output_ids": [5, 6, 7], "finish_reason": "stop", "version": raw_label,
            "token_versions": [[" v1 ", 1], [raw_label, 1], [None, 1]]}
    chunk = decode(_wire("chunk", data))
    assert isinstance(chunk, Chunk)
    assert chunk.version is None
    assert chunk.token_versions == [("v1", 1), (None, 1), (None, 1)]
    assert chunk.output_versions() == ["v1", None, None]


def test_labels_are_stripped_but_keep_their_case() -> None:
    assert _chunk(output_ids=[5], version=" V2 ").version == "V2"


def test_a_raw_label_in_a_group_decodes_to_none_token_by_token() -> None:
    group = CompletedGroup.model_validate({
        "group_id": "g", "prompt_id": "p", "failed": False,
        "trajectories": [{"session_id": "s", "status": "completed", "segments": [{
            "segment_index": 0, "token_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 1, 1],
            "logprobs": [0.0] * 5, "versions": [None, " v1 ", "unknown", "-1", "v2"]}]}],
    })
    back = decode(encode(group))
    assert isinstance(back, CompletedGroup)
    assert back.trajectories[0].segments[0].versions == [None, "v1", None, None, "v2"]


def test_window_versions_are_normalised() -> None:
    empty = WindowInfo(keep_versions=2, current_version="-1", current_index=None, cutoff_index=None)
    assert empty.current_version is None
    assert WindowInfo(keep_versions=2, current_version=" v3", current_index=3, cutoff_index=2).current_version == "v3"
    decision = DecisionRecord(group_id="g", prompt_id="p", attempt=0, decision="kept", versions=[" v1 "],
                              window=WindowInfo(keep_versions=1, current_version="v1", current_index=0, cutoff_index=0))
    assert decision.versions == ["v1"]
    with pytest.raises(ValueError, match="not a real version label"):
        DecisionRecord.model_validate({**decision.model_dump(), "versions": ["v1", "unknown"]})


@pytest.mark.parametrize("raw_label", [label for label in NOT_REAL if label is not None])
def test_a_weight_version_must_be_a_real_label(raw_label: str) -> None:
    published = {"version": raw_label, "seq": 1, "path": "p", "digest": "d", "step": 1}
    with pytest.raises(DecodeError, match="invalid_fields"):
        decode(_wire("weight_published", published))
    with pytest.raises(ValueError, match="not a real version label"):
        WeightApplied(version=raw_label, seq=1, digest="d")


def test_a_weight_version_is_stripped_once() -> None:
    back = decode(_wire("weight_published", {"version": " v7 ", "seq": 7, "path": "p", "digest": "d", "step": 7}))
    assert isinstance(back, WeightPublished) and back.version == "v7" and back.key() == "v7"
    assert WeightApplied(version="v7 ", seq=7, digest="d").key() == "v7:applied"
