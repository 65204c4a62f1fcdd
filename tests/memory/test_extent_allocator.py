"""ExtentAllocator: size classes, exact fit semantics and coalescing, checked against a brute-force model."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvferry.memory.extent_allocator import ExtentAllocator, class_min_units, size_class


def free_gaps(total: int, live: dict[int, int]) -> list[int]:
    """Sizes of the maximal free ranges left between the ``live`` ranges (start -> units) of ``total``."""
    gaps = []
    cursor = 0
    for start in sorted(live):
        assert start >= cursor, f"live range at {start} overlaps the one ending at {cursor}"
        if start > cursor:
            gaps.append(start - cursor)
        cursor = start + live[start]
    assert cursor <= total
    if cursor < total:
        gaps.append(total - cursor)
    return gaps


def test_size_classes_partition_sizes_in_order() -> None:
    previous = -1
    for units in range(1, 1 << 14):
        index = size_class(units)
        assert index >= previous, "classes must grow with size"
        assert class_min_units(index) <= units < class_min_units(index + 1)
        previous = index
    # Boundaries invert exactly, and a class spans at most 1/16 of its smallest size.
    for index in range(1, size_class(1 << 40)):
        low, high = class_min_units(index), class_min_units(index + 1)
        assert size_class(low) == index
        assert (high - low) * 16 <= max(low, 16)


@pytest.mark.parametrize("bad", [0, -3])
def test_rejects_non_positive_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        ExtentAllocator(bad)
    with pytest.raises(ValueError, match="must be positive"):
        ExtentAllocator(8).reserve(bad)


def test_fills_exactly_then_fails() -> None:
    extents = ExtentAllocator(100)
    starts = [extents.reserve(10) for _ in range(10)]
    assert sorted(starts) == list(range(0, 100, 10))
    assert extents.free_units == 0
    assert extents.reserve(1) is None
    assert extents.largest_free_units == 0
    assert extents.num_free_extents == 0


def test_request_above_its_class_minimum_still_fits_the_last_extent() -> None:
    # 33 units is in the class [32, 34): a rounded-up search finds nothing, the own-class scan must.
    extents = ExtentAllocator(33)
    assert extents.reserve(33) == 0
    assert extents.free_units == 0


def test_request_larger_than_total_fails() -> None:
    assert ExtentAllocator(64).reserve(65) is None


def test_release_merges_left_right_and_both_neighbours() -> None:
    extents = ExtentAllocator(40)
    a, b, c, d = (extents.reserve(10) for _ in range(4))
    assert extents.num_free_extents == 0
    extents.release(a, 10)
    extents.release(c, 10)
    assert extents.num_free_extents == 2
    assert extents.largest_free_units == 10
    extents.release(b, 10)  # merges with both neighbours
    assert extents.num_free_extents == 1
    assert extents.largest_free_units == 30
    extents.release(d, 10)  # merges with its left neighbour
    assert extents.num_free_extents == 1
    assert extents.largest_free_units == extents.total_units == extents.free_units == 40
    assert extents.reserve(40) == 0


def test_random_churn_matches_model() -> None:
    rng = random.Random(1234)
    total = 5000
    extents = ExtentAllocator(total)
    live: dict[int, int] = {}
    for step in range(20_000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            extents.release(start, live.pop(start))
        else:
            units = rng.choice([1, 2, 3, rng.randint(1, 64), rng.randint(1, 700)])
            start = extents.reserve(units)
            gaps = free_gaps(total, live)
            if start is None:
                assert max(gaps, default=0) < units
            else:
                live[start] = units
        if step % 97 == 0:
            gaps = free_gaps(total, live)
            assert extents.free_units == sum(gaps)
            assert extents.num_free_extents == len(gaps) <= len(live) + 1
            assert extents.largest_free_units == max(gaps, default=0)
    for start, units in live.items():
        extents.release(start, units)
    assert extents.num_free_extents == 1
    assert extents.largest_free_units == total


class ExtentAllocatorMachine(RuleBasedStateMachine):
    """Every reservation lands in a free gap, succeeds iff a gap is big enough; the free list is exact."""

    @initialize(total=st.integers(1, 3000))
    def create(self, total: int) -> None:
        self.total = total
        self.extents = ExtentAllocator(total)
        self.live: dict[int, int] = {}

    @rule(units=st.one_of(st.integers(1, 40), st.integers(1, 3000)))
    def reserve(self, units: int) -> None:
        largest_gap = max(free_gaps(self.total, self.live), default=0)
        start = self.extents.reserve(units)
        if start is None:
            assert largest_gap < units
        else:
            assert start >= 0 and start + units <= self.total
            self.live[start] = units
            free_gaps(self.total, self.live)  # asserts no overlap

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        start = data.draw(st.sampled_from(sorted(self.live)))
        self.extents.release(start, self.live.pop(start))

    @invariant()
    def free_list_is_exact(self) -> None:
        gaps = free_gaps(self.total, self.live)
        assert self.extents.free_units == sum(gaps)
        assert self.extents.num_free_extents == len(gaps) <= len(self.live) + 1
        assert self.extents.largest_free_units == max(gaps, default=0)


ExtentAllocatorMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_extent_allocator_machine = ExtentAllocatorMachine.TestCase
