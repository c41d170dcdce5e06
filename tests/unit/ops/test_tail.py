"""Pure parts of ``rein tail``: argument parsing, session matching, rendering one record."""

from __future__ import annotations

from typing import Any

import pytest

from ops.cli import main
from ops.tail import Start, Tailer, TailError, TailOptions, parse_duration, parse_offset, render, session_matches
from shared.codec import encode
from shared.schemas import SessionFinished
from shared.settings import KafkaSettings


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10m", 600.0), ("90s", 90.0), ("90", 90.0), ("2h", 7200.0), ("1d", 86400.0), ("500ms", 0.5), (" 1.5h ", 5400.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "10x", "-5m", "0s", "10 m s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "expected"), [("0:0", (0, 0)), ("3:120", (3, 120))])
def test_parse_offset(text: str, expected: tuple[int, int]) -> None:
    assert parse_offset(text) == expected


@pytest.mark.parametrize("text", ["3", "3:", ":4", "a:1", "1:-1", "-1:0", "1:2:3"])
def test_parse_offset_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="PARTITION:OFFSET"):
        parse_offset(text)


def test_since_is_relative_to_now() -> None:
    assert Start.since(600, now_s=1_000_000.0) == Start("since", since_ms=999_400_000)


@pytest.mark.parametrize(
    ("record", "matches"),
    [
        ({"session_id": "s1"}, True),
        ({"session_id": "s2"}, False),
        ({"session_ids": ["s0", "s1"]}, True),
        ({"session_ids": ["s0"]}, False),
        ({"trajectories": [{"session_id": "s2"}, {"session_id": "s1"}]}, True),
        ({"trajectories": [{"session_id": "s2"}]}, False),
        ({"batch_id": "b", "groups": []}, False),
    ],
)
def test_session_matches(record: dict[str, Any], matches: bool) -> None:
    assert session_matches(record, "s1") is matches


def test_render_record_and_errors() -> None:
    record = SessionFinished(session_id="s1", group_id="g1", reward=0.5, num_chunks=1)
    line, error = render("t", 1, 7, 123, b"g1", encode(record), 1 << 20)
    assert error is None
    assert line == {
        "topic": "t",
        "partition": 1,
        "offset": 7,
        "timestamp_ms": 123,
        "key": "g1",
        "record": record.model_dump(mode="json"),
    }

    line, error = render("t", 0, 1, 5, None, encode(record), 10)
    assert error is not None and error.reason == "oversize"
    assert line["key"] is None and "record" not in line
    assert line["error"].startswith("oversize: ")

    line, error = render("t", 0, 2, 5, b"\xff", b"\x93\x01\x02\x03", 1 << 20)
    assert line["key"] == "\ufffd"
    assert line["error"].startswith("bad_envelope: ")


def test_offset_with_group_is_refused() -> None:
    with pytest.raises(TailError, match="--group-id"):
        Tailer(KafkaSettings(), TailOptions("t", start=Start.at(0, 0), group_id="g"), print)


@pytest.mark.parametrize(
    "args",
    [
        ["tail", "t", "--since", "soon"],
        ["tail", "t", "--offset", "x"],
        ["tail", "t", "--offset", "0:0", "--group-id", "g"],
        ["tail", "t", "--max", "0"],
        ["tail", "t", "--timeout", "-1"],
    ],
)
def test_bad_arguments_exit_2_without_contacting_kafka(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert "rein tail: error:" in capsys.readouterr().err


def test_start_flags_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tail", "t", "--from-beginning", "--since", "1m"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["tail", "report"])
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert command in capsys.readouterr().out
