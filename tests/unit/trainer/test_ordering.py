"""Manifest order/dedupe buffer."""

from __future__ import annotations

import pytest

from services.trainer.ordering import ManifestOrder


def test_in_order_passes_straight_through() -> None:
    order: ManifestOrder[str] = ManifestOrder(next_index=0)
    assert order.offer(0, "a").ready == [(0, "a")]
    assert order.offer(1, "b").ready == [(1, "b")]
    assert order.next_index == 2 and order.buffered == 0


def test_out_of_order_is_buffered_until_the_gap_fills() -> None:
    order: ManifestOrder[str] = ManifestOrder(next_index=0)
    assert order.offer(2, "c").ready == []
    assert order.offer(1, "b").ready == []
    assert order.buffered_indices() == [1, 2]
    assert order.offer(0, "a").ready == [(0, "a"), (1, "b"), (2, "c")]
    assert order.buffered == 0


@pytest.mark.parametrize(
    ("offers", "expected_ready", "duplicates"),
    [
        ([0, 0, 1], [0, 1], [False, True, False]),  # republished after a collector crash
        ([1, 1, 0], [0, 1], [False, True, False]),  # duplicate while buffered
        ([0, 1, 0, 1], [0, 1], [False, False, True, True]),  # replay of trained ones
    ],
)
def test_each_index_is_released_once(offers: list[int], expected_ready: list[int], duplicates: list[bool]) -> None:
    order: ManifestOrder[int] = ManifestOrder(next_index=0)
    released: list[int] = []
    seen_dups: list[bool] = []
    for i in offers:
        result = order.offer(i, i)
        released += [idx for idx, _ in result.ready]
        seen_dups.append(result.duplicate)
    assert released == expected_ready
    assert seen_dups == duplicates


def test_resume_skips_indices_already_in_the_checkpoint() -> None:
    order: ManifestOrder[str] = ManifestOrder(next_index=5)
    assert order.offer(3, "old").duplicate
    assert order.offer(5, "new").ready == [(5, "new")]
