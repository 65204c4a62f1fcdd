"""How the GPU pipeline cuts a request into slices (pure arithmetic: runs on the CPU).

Every row of every object after the skipped ones is moved exactly once, in order; a slice is whole consecutive
objects or one object's row range; no slice outgrows the slot or the target (beyond one object row).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.transfer.schedule import cut_slices

MiB = 1 << 20


def _moved(slices: list, rows: int) -> list[tuple[int, int]]:
    """(object, row) pairs in the order the slices move them."""
    out = []
    for sl in slices:
        if sl.rows is None:
            assert sl.members == list(range(sl.members[0], sl.members[-1] + 1)), "whole objects must be consecutive"
            out += [(o, r) for o in sl.members for r in range(rows)]
        else:
            assert len(sl.members) == 1 and 0 <= sl.rows[0] < sl.rows[1] <= rows
            out += [(sl.members[0], r) for r in range(*sl.rows)]
    return out


def _bytes(sl, sizes: list[int], rows: int) -> int:  # type: ignore[no-untyped-def]
    if sl.rows is None:
        return sum(sizes[o] for o in sl.members)
    return (sl.rows[1] - sl.rows[0]) * (sizes[sl.members[0]] // rows)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 64),
    row_kib=st.integers(1, 2048),
    n=st.integers(1, 40),
    partial=st.integers(0, 100),
    first_frac=st.floats(0, 1),
    target_mib=st.integers(1, 32),
)
def test_every_row_once_in_order_within_limits(
    rows: int, row_kib: int, n: int, partial: int, first_frac: float, target_mib: int
) -> None:
    row_bytes = row_kib * 1024
    sizes = [rows * row_bytes] * n
    sizes[-1] = rows * max(1, row_bytes * partial // 100)  # the last object may be partial (fewer tokens)
    first = min(int(first_frac * n), n - 1)
    target, slot = target_mib * MiB, 2 * max(target_mib * MiB, 2 * MiB)
    slices = cut_slices(sizes, first, rows, slot, target)
    assert _moved(slices, rows) == [(o, r) for o in range(first, n) for r in range(rows)]
    for sl in slices:
        assert _bytes(sl, sizes, rows) <= max(target, sizes[sl.members[0]] // rows) <= slot


def test_one_llama_chunk_is_cut_into_row_ranges() -> None:
    slices = cut_slices([32 * MiB], 0, 64, 64 * MiB, 12 * MiB)  # 2 planes x 32 layers of 512 KiB rows
    assert [(sl.members, sl.rows) for sl in slices] == [([0], (0, 24)), ([0], (24, 48)), ([0], (48, 64))]


def test_small_objects_are_grouped_up_to_the_target() -> None:
    slices = cut_slices([3 * MiB] * 8, 1, 48, 64 * MiB, 12 * MiB)
    assert [sl.members for sl in slices] == [[1, 2, 3, 4], [5, 6, 7]]


def test_a_row_larger_than_a_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        cut_slices([8 * MiB], 0, 2, 2 * MiB, 1 * MiB)
