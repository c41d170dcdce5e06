"""The trainer's loss mask over weight versions (``mask_nonlast_version_tokens``), rein's last staleness
level: in a sequence whose trainable tokens span several versions only those of the last one stay trained
(by position, not by age), and the mask only ever takes tokens out, so applying it twice changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.trainer.samples import mask_nonlast_version_tokens


def test_mask_aba_keeps_both_a_runs() -> None:
    assert mask_nonlast_version_tokens([1, 1, 1, 1, 1], ["A", "A", "B", "A", "A"]) == [1, 1, 0, 1, 1]


def test_mask_last_is_positional_not_newest() -> None:
    assert mask_nonlast_version_tokens([1, 1, 1], ["v2", "v1", "v1"]) == [0, 1, 1]


def test_mask_unknown_trainable_tokens_masked_only_in_mixed_case() -> None:
    assert mask_nonlast_version_tokens([1, 1, 1], ["v1", None, "v1"]) == [1, 1, 1]
    assert mask_nonlast_version_tokens([1, 1, 1, 1], ["v1", None, "v2", "v2"]) == [0, 0, 1, 1]


def test_mask_versions_on_context_tokens_play_no_part() -> None:
    assert mask_nonlast_version_tokens([0, 1, 0, 1], [None, "v1", "v2", "v1"]) == [0, 1, 0, 1]


def test_mask_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="versions has 1"):
        mask_nonlast_version_tokens([1, 1], ["v1"])


version_values = st.sampled_from(["A", "B", "C", None])


@given(st.lists(st.tuples(st.integers(0, 1), version_values), max_size=40))
def test_mask_never_turns_zero_into_one_and_is_idempotent(pairs: list[tuple[int, str | None]]) -> None:
    mask = [m for m, _ in pairs]
    versions = [v for _, v in pairs]
    once = mask_nonlast_version_tokens(mask, versions)
    assert all(new <= old for new, old in zip(once, mask, strict=True))
    assert mask_nonlast_version_tokens(once, versions) == once
