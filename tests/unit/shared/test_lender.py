"""Lender makes an item only when every item is lent, lends the last one returned, and always takes it back."""

from __future__ import annotations

import itertools
from contextlib import ExitStack

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.lender import Lender


def counter() -> Lender[int]:
    made = itertools.count()
    return Lender(lambda: next(made))


def test_sequential_uses_reuse_one_item() -> None:
    """Light load: one call at a time keeps reusing one client (its kept-alive connection)."""
    lender = counter()
    for _ in range(5):
        with lender.use() as item:
            assert item == 0
    assert lender.items == [0] and lender.lent == 0


def test_overlapping_uses_get_distinct_items_and_the_last_returned_comes_back_first() -> None:
    lender = counter()
    with ExitStack() as outer:
        first = outer.enter_context(lender.use())
        with lender.use() as second, lender.use() as third:
            assert (first, second, third) == (0, 1, 2)
            assert lender.lent == 3
        with lender.use() as again:
            assert again == 1  # 2 went back first, then 1: 1 is the last returned
    assert lender.items == [0, 1, 2] and lender.lent == 0


def test_a_failing_block_gives_its_item_back() -> None:
    lender = counter()
    with pytest.raises(RuntimeError), lender.use():
        raise RuntimeError("engine unreachable")
    assert lender.lent == 0
    with lender.use() as item:
        assert item == 0


@given(st.lists(st.one_of(st.just(None), st.integers(0, 50)), max_size=60))
def test_items_made_are_the_most_ever_lent_at_once(ops: list[int | None]) -> None:
    """Any interleaving of takes (None) and returns (an index into what is lent): no item is lent
    twice at once, and an item is made only when every item made is lent."""
    lender = counter()
    lent: list[tuple[ExitStack, int]] = []
    peak = 0
    for op in ops:
        if op is None:
            stack = ExitStack()
            item = stack.enter_context(lender.use())
            assert item not in [i for _, i in lent]
            lent.append((stack, item))
            peak = max(peak, len(lent))
        elif lent:
            stack, _ = lent.pop(op % len(lent))
            stack.close()
        assert lender.lent == len(lent)
        assert len(lender.items) == peak
    for stack, _ in lent:
        stack.close()
    assert lender.lent == 0
