"""``rein tail`` against the real broker: records produced here come back as JSON lines.

From the beginning, by time (``--since``), by offset (``--offset P:O``), filtered by
session, through a consumer group (commits: a second run resumes), following new
records, and a malformed record shows as an error line without stopping the read.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer

from ops.cli import main
from shared.bus import Delivered, Producer
from shared.codec import encode
from shared.schemas import Chunk, GroupDispatched, Record, SessionFinished
from shared.settings import KafkaSettings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
GROUP = "grp-1"
SESSIONS = ("sess-a", "sess-b")


def _chunk(session: str, seq: int, group: str = GROUP) -> Chunk:
    return Chunk(
        session_id=session,
        group_id=group,
        prompt_id="p-1",
        seq=seq,
        segment_index=0,
        chunk_index=seq,
        output_ids=[seq, seq + 1],
        logprobs=[-0.5, -0.25],
        version="v1",
        finish_reason="stop",
    )


def _group_records() -> list[Record]:
    """One group of two sessions: dispatched, two chunks each, finished."""
    records: list[Record] = [GroupDispatched(group_id=GROUP, prompt_id="p-1", session_ids=list(SESSIONS))]
    for session in SESSIONS:
        records += [_chunk(session, 0), _chunk(session, 1)]
        records.append(SessionFinished(session_id=session, group_id=GROUP, reward=1.0, num_chunks=2))
    return records


@pytest.fixture
def producer(kafka_bootstrap: str) -> Iterator[Producer]:
    p = Producer(KafkaSettings(bootstrap_servers=kafka_bootstrap), client_suffix="test-tail")
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def raw_producer(kafka_bootstrap: str) -> Iterator[KafkaProducer]:
    p = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    try:
        yield p
    finally:
        p.close(timeout=10)


Tailed = tuple[int, list[dict[str, Any]], str]
"""``rein tail``'s exit code, its output as JSON lines, and its stderr."""


def _tail(capsys: pytest.CaptureFixture[str], *args: str) -> Tailed:
    code = main(["tail", *args])
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines() if line.strip()]
    return code, lines, captured.err


@pytest.fixture
def tail(kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> Callable[..., Tailed]:
    """``rein tail ARGS --bootstrap <the test broker>``, in this process."""
    return lambda *args: _tail(capsys, *args, "--bootstrap", kafka_bootstrap)


def _positions(lines: list[dict[str, Any]]) -> set[tuple[int, int]]:
    return {(line["partition"], line["offset"]) for line in lines}


def _delivered(deliveries: Iterable[Delivered]) -> set[tuple[int, int]]:
    return {(d.partition, d.offset) for d in deliveries}


def test_from_beginning_decodes_every_record_and_reports_malformed(
    tail: Callable[..., Tailed], unique_topic: Callable[..., str], producer: Producer, raw_producer: KafkaProducer
) -> None:
    topic = unique_topic(2)
    sent = producer.send_many((topic, r) for r in _group_records())
    bad = raw_producer.send(topic, key=b"grp-bad", value=b"\xc1 not msgpack", partition=1).get(timeout=30)
    after = producer.send(topic, _chunk("sess-c", 0, group="grp-2"))  # read continues past the bad record

    code, lines, err = tail(topic, "--from-beginning")

    assert code == 0
    expected = _delivered([*sent, after]) | {(bad.partition, bad.offset)}
    assert _positions(lines) == expected
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1
    assert errors[0]["error"].startswith("not_msgpack: ")
    assert errors[0]["key"] == "grp-bad" and "record" not in errors[0]
    good = [line for line in lines if "record" in line]
    assert all(set(line) == {"topic", "partition", "offset", "timestamp_ms", "key", "record"} for line in good)
    assert {line["topic"] for line in lines} == {topic}
    assert {line["key"] for line in good} == {GROUP, "grp-2"}
    chunk = next(line["record"] for line in good if line["record"]["type"] == "chunk")
    assert chunk["version"] == "v1" and chunk["logprobs"] == [-0.5, -0.25]
    assert all(line["timestamp_ms"] > 0 for line in lines)
    assert "1 malformed records (not_msgpack=1)" in err


def test_since_skips_older_records(
    tail: Callable[..., Tailed], unique_topic: Callable[..., str], raw_producer: KafkaProducer
) -> None:
    topic = unique_topic(2)
    now_ms = int(time.time() * 1000)
    for seq, ts in enumerate([now_ms - 3_600_000, now_ms - 1_800_000, now_ms - 60_000, now_ms]):
        record = _chunk("sess-a", seq)
        raw_producer.send(topic, key=record.key().encode(), value=encode(record), timestamp_ms=ts)
    raw_producer.flush(timeout=30)

    code, lines, _ = tail(topic, "--since", "10m")
    assert code == 0
    assert sorted(line["record"]["seq"] for line in lines) == [2, 3]

    code, lines, _ = tail(topic, "--since", "45m")
    assert code == 0
    assert sorted(line["record"]["seq"] for line in lines) == [1, 2, 3]


def test_offset_reads_one_partition_from_an_offset(
    tail: Callable[..., Tailed], unique_topic: Callable[..., str], producer: Producer
) -> None:
    topic = unique_topic(2)
    delivered = producer.send_many((topic, _chunk("sess-a", seq)) for seq in range(5))
    partition = delivered[0].partition  # one key: every record on one partition
    assert [d.offset for d in delivered] == [0, 1, 2, 3, 4]

    code, lines, _ = tail(topic, "--offset", f"{partition}:3")
    assert code == 0
    assert [(line["partition"], line["offset"], line["record"]["seq"]) for line in lines] == [
        (partition, 3, 3),
        (partition, 4, 4),
    ]

    code, lines, _ = tail(topic, "--offset", f"{partition}:1", "--max", "2")
    assert code == 0
    assert [line["offset"] for line in lines] == [1, 2]

    code, lines, err = tail(topic, "--offset", f"{partition}:99")
    assert code == 1 and lines == []
    assert "outside" in err

    code, _, err = tail(topic, "--offset", "7:0")
    assert code == 1 and "not 7" in err


def test_session_filter(
    tail: Callable[..., Tailed], unique_topic: Callable[..., str], producer: Producer, raw_producer: KafkaProducer
) -> None:
    topic = unique_topic(2)
    producer.send_many((topic, r) for r in _group_records())
    raw_producer.send(topic, key=b"x", value=None).get(timeout=30)  # a tombstone: shown as an error line

    code, lines, err = tail(topic, "--from-beginning", "--session", "sess-b")

    assert code == 0
    records = [line["record"] for line in lines if "record" in line]
    assert sorted(r["type"] for r in records) == ["chunk", "chunk", "group_dispatched", "session_finished"]
    assert all(r.get("session_id", "sess-b") == "sess-b" for r in records)
    assert [line["error"].split(":")[0] for line in lines if "error" in line] == ["empty"]
    assert "3 filtered out" in err


def test_group_commits_so_a_second_run_resumes(
    tail: Callable[..., Tailed], unique_topic: Callable[..., str], unique_group: str, producer: Producer
) -> None:
    topic = unique_topic(2)
    first = producer.send_many((topic, _chunk(s, seq)) for s in SESSIONS for seq in range(2))
    args = ("--group-id", unique_group, "--timeout", "60")

    code, lines, _ = tail(topic, *args)
    assert code == 0
    assert _positions(lines) == _delivered(first)

    code, lines, _ = tail(topic, *args)
    assert code == 0 and lines == []

    second = producer.send(topic, _chunk("sess-z", 9, group="grp-9"))
    code, lines, _ = tail(topic, *args)
    assert code == 0
    assert _positions(lines) == _delivered([second])


def test_follow_prints_records_produced_while_running(
    kafka_bootstrap: str, unique_topic: Callable[..., str], producer: Producer
) -> None:
    """``rein tail --follow`` as a process: it prints what the topic held, then each record produced
    after that line came out (a tail that stopped at the end, or read only what it found, would not)."""
    topic = unique_topic(1)
    producer.send(topic, _chunk("sess-a", 0))
    command = [sys.executable, "-m", "ops.cli", "tail", topic, "--follow", "--from-beginning", "--max", "3",
               "--timeout", "60", "--bootstrap", kafka_bootstrap]
    lines: queue.Queue[str | None] = queue.Queue()
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as follower:

        def read() -> None:
            for line in follower.stdout or ():
                lines.put(line)
            lines.put(None)  # the follower closed its output: it exited

        def next_seq() -> int:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                line = "(nothing within 60 s)"
            if line is None or not line.startswith("{"):
                follower.kill()
                stderr = follower.stderr.read() if follower.stderr else ""
                raise AssertionError(f"rein tail --follow printed no next record: {line or 'it exited'}; {stderr}")
            return int(json.loads(line)["record"]["seq"])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert next_seq() == 0  # the follower is reading: what is produced from now on came after its start
            producer.send(topic, _chunk("sess-a", 1))
            assert next_seq() == 1
            producer.send(topic, _chunk("sess-a", 2))
            assert next_seq() == 2
            assert follower.wait(timeout=30) == 0  # --max 3 reached
        finally:
            if follower.poll() is None:
                follower.kill()
            follower.wait(timeout=10)
            reader.join(timeout=10)


def test_unknown_topic_is_an_error(tail: Callable[..., Tailed]) -> None:
    code, lines, err = tail("no.such.topic.for.tail")
    assert code == 1 and lines == []
    assert "does not exist" in err


def test_run_dir_gives_the_broker(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    producer: Producer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """After `rein up --run-dir X`, `rein tail --run-dir X` finds the broker in X/stack.json."""
    topic = unique_topic(1)
    sent = producer.send_many((topic, r) for r in _group_records())
    (tmp_path / "stack.json").write_text(json.dumps({"infra": {"kafka_bootstrap": kafka_bootstrap}}))
    code, lines, _ = _tail(capsys, topic, "--from-beginning", "--run-dir", str(tmp_path))
    assert code == 0
    assert _positions(lines) == _delivered(sent)


def test_unreadable_run_dir_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, err = _tail(capsys, "rollout.chunks", "--run-dir", str(tmp_path / "missing"))
    assert code == 2 and lines == []
    assert "stack.json" in err
