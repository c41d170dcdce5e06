from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.versions import VersionRegistry, decode_runs, distinct_real, encode_runs, real_version


@pytest.mark.parametrize("value", [None, "", "  ", "-1", " -1 ", -1, "unknown", "UNKNOWN", " UNKNOWN ", "none", "None"])
def test_not_real_values_never_count(value: object) -> None:
    assert real_version(value) is None


@pytest.mark.parametrize(
    ("value", "label"), [("v1", "v1"), (" v1 ", "v1"), (0, "0"), ("0", "0"), (7, "7"), ("V2", "V2")]
)
def test_real_values_are_stripped_once(value: object, label: str) -> None:
    assert real_version(value) == label


def test_bool_is_not_a_version() -> None:
    assert real_version(True) is None


def test_distinct_real_keeps_first_occurrence_order() -> None:
    assert distinct_real(["v2", None, "v1", "v2", None, "v3", "v1"]) == ["v2", "v1", "v3"]


def test_labels_are_ordered_by_registry_not_text() -> None:
    reg = VersionRegistry()
    reg.publish("v2", 2)
    reg.publish("v10", 10)
    assert reg.index("v2") < reg.index("v10")
    reg.publish("v9", 9)
    assert [reg.index(v) for v in ("v2", "v9", "v10")] == [0, 1, 2]


def test_unregistered_labels_come_after_published_in_observation_order() -> None:
    reg = VersionRegistry()
    reg.publish("a", 1)
    reg.observe("engine-own")
    reg.observe("zz")
    reg.publish("b", 2)
    assert [reg.index(v) for v in ("a", "b", "engine-own", "zz")] == [0, 1, 2, 3]
    assert reg.unregistered == ["engine-own", "zz"]


def test_late_publication_moves_label_into_order() -> None:
    reg = VersionRegistry()
    reg.publish("v1", 1)
    reg.observe("v0")
    assert reg.index("v0") == 1
    reg.publish("v0", 0)
    assert reg.index("v0") == 0
    assert reg.index("v1") == 1
    assert reg.unregistered == []


def test_publish_is_idempotent_and_conflicts_are_errors() -> None:
    reg = VersionRegistry()
    assert reg.publish("v1", 1) is True
    assert reg.publish("v1", 1) is False
    with pytest.raises(ValueError, match="already published"):
        reg.publish("v1", 2)
    with pytest.raises(ValueError, match="already used"):
        reg.publish("v9", 1)


def test_unknown_label_lookup_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="never published"):
        VersionRegistry().index("ghost")


@given(st.lists(st.integers(min_value=0, max_value=10_000), unique=True, min_size=1, max_size=50))
def test_index_is_rank_of_sequence(seqs: list[int]) -> None:
    reg = VersionRegistry()
    for s in seqs:
        reg.publish(f"v{s}", s)
    for rank, s in enumerate(sorted(seqs)):
        assert reg.index(f"v{s}") == rank


@pytest.mark.parametrize(
    ("labels", "runs"),
    [
        ([], []),
        (["v1"], [("v1", 1)]),
        (["v1", "v1", "v2", "v2", "v2"], [("v1", 2), ("v2", 3)]),
        (["v1", None, None, "v1"], [("v1", 1), (None, 2), ("v1", 1)]),  # runs, not a histogram
    ],
)
def test_version_runs(labels: list[str | None], runs: list[tuple[str | None, int]]) -> None:
    assert encode_runs(labels) == runs
    assert decode_runs(runs) == labels


@given(st.lists(st.sampled_from(["v1", "v2", None]), max_size=50))
def test_version_runs_round_trip_and_are_maximal(labels: list[str | None]) -> None:
    runs = encode_runs(labels)
    assert decode_runs(runs) == labels
    assert all(a[0] != b[0] for a, b in itertools.pairwise(runs))
