"""shared.log: module loggers made at import follow the configuration set later."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime

import pytest
import structlog

from shared import log


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def test_a_logger_made_before_configure_renders_as_configured(
    restore_structlog: None, capsys: pytest.CaptureFixture[str]
) -> None:
    early = log.get("some.module")  # as a module-level ``_log`` is, at import
    log.configure("svc", "info", json=True)
    early.debug("not_shown")
    early.info("paused", waited_s=0.25)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["paused"], "JSON on stderr, debug filtered out"
    assert lines[0]["logger_name"] == "some.module"
    assert lines[0]["waited_s"] == 0.25
    stamp = datetime.fromisoformat(lines[0]["timestamp"].replace("Z", "+00:00"))
    assert stamp.microsecond or "." in lines[0]["timestamp"], "sub-second timestamps"
