"""The proxy's span cap (``shared/span_cap.py``), rein's first staleness level: how many distinct real
weight versions one session may span before it is rejected, and the rejection's body as the design gives
it; unknown versions and repeats of a version never count."""

from __future__ import annotations

import pytest

from shared.span_cap import check_span


def test_span_detail_matches_design_body() -> None:
    rej = check_span(["v1", None, "v2"], ["v3"], max_preempts=1, session_id="s1")
    assert rej is not None
    assert rej.detail() == {
        "error": "partial_rollout_staleness_exceeded",
        "message": rej.detail()["message"],
        "versions": ["v1", "v2", "v3"],
        "version_span": 3,
        "version_switches": 2,
        "max_preempts": 1,
        "max_version_span": 2,
        "session_id": "s1",
    }


def test_span_zero_rejects_first_switch_and_unlimited_never() -> None:
    assert check_span(["v1"], ["v1"], 0, "s") is None
    assert check_span(["v1"], ["v2"], 0, "s") is not None
    assert check_span([f"v{i}" for i in range(50)], ["v99"], None, "s") is None


def test_span_ignores_unknown_versions_and_counts_distinct_not_events() -> None:
    assert check_span(["v1", None, None], [None, "v1", "v1"], 0, "s") is None
    assert check_span(["v1", "v2", "v1", "v2"], ["v1"], 1, "s") is None


def test_span_rejects_negative_cap() -> None:
    with pytest.raises(ValueError):
        check_span([], [], -1, "s")
