"""Two-level segregated-fit (TLSF-style) allocator over a range of abstract units.

The allocator knows nothing about bytes or tensors: it hands out ``[offset, offset + units)`` ranges of a
space of ``total_units`` units, and the host pool maps one unit to one alignment quantum of its slab.

Invariants (checked by the tests against a brute-force model):

* Free extents are maximal: a released range is merged with free neighbours at once, so two free extents
  never touch. Hence the number of free extents is at most ``live allocations + 1`` and freeing everything
  leaves one extent covering the whole space -- fragmentation cannot grow without bound.
* A reservation of ``n`` units succeeds iff some free extent holds at least ``n`` units.
* ``reserve`` and ``release`` do O(1) dictionary work plus a few big-int bit operations on a bitmap whose
  width grows with log2(total_units); only ``reserve`` in a nearly full space may scan one size class (see
  ``_reserve_from_own_class``).
"""

from __future__ import annotations

# Each power-of-two size range is split into 2**_SUB_BITS classes, so an extent in a class is at most
# 1/16 larger than the class's smallest size. Sizes below 2**_SUB_BITS get one exact class each.
_SUB_BITS = 4
_SUB_COUNT = 1 << _SUB_BITS
_SUB_MASK = _SUB_COUNT - 1


def size_class(units: int) -> int:
    """Index of the class that holds free extents of ``units`` units (classes grow with size)."""
    if units < _SUB_COUNT:
        return units
    shift = units.bit_length() - 1 - _SUB_BITS
    return ((shift + 1) << _SUB_BITS) | ((units >> shift) & _SUB_MASK)


def class_min_units(index: int) -> int:
    """Smallest size that belongs to class ``index`` (inverse of ``size_class`` on class boundaries)."""
    if index < _SUB_COUNT:
        return index
    shift = (index >> _SUB_BITS) - 1
    return (_SUB_COUNT | (index & _SUB_MASK)) << shift


class ExtentAllocator:
    """Good-fit allocator of unit ranges with immediate coalescing; not thread-safe (callers lock)."""

    __slots__ = ("_by_end", "_by_start", "_classes", "_free_units", "_nonempty", "_total_units")

    def __init__(self, total_units: int) -> None:
        if total_units <= 0:
            raise ValueError(f"total_units={total_units} must be positive")
        self._total_units = total_units
        # One dict per size class, used as an insertion-ordered set of extent start offsets: popitem()
        # takes the most recently freed extent (warm in cache) in O(1), and del removes any in O(1).
        self._classes: list[dict[int, None]] = [{} for _ in range(size_class(total_units) + 1)]
        self._nonempty = 0  # bit i set iff self._classes[i] is not empty
        self._by_start: dict[int, int] = {}  # free extent start -> size
        self._by_end: dict[int, int] = {}  # free extent end (exclusive) -> start
        self._free_units = 0
        self._add_free(0, total_units)

    @property
    def total_units(self) -> int:
        return self._total_units

    @property
    def free_units(self) -> int:
        return self._free_units

    @property
    def num_free_extents(self) -> int:
        return len(self._by_start)

    @property
    def largest_free_units(self) -> int:
        """Size of the largest free extent: scans the highest non-empty class, O(extents in it)."""
        if not self._nonempty:
            return 0
        top = self._classes[self._nonempty.bit_length() - 1]
        return max(self._by_start[start] for start in top)

    def reserve(self, units: int) -> int | None:
        """Take ``units`` units from the lowest end of a fitting free extent; None if none fits."""
        if units <= 0:
            raise ValueError(f"units={units} must be positive")
        if units > self._free_units:
            return None
        # Start at the first class whose every extent fits: the request's own class only if the request
        # is that class's smallest size.
        first = size_class(units)
        if class_min_units(first) < units:
            first += 1
        candidates = self._nonempty >> first
        if not candidates:
            return self._reserve_from_own_class(units)
        index = first + (candidates & -candidates).bit_length() - 1
        members = self._classes[index]
        start, _ = members.popitem()
        if not members:
            self._nonempty &= ~(1 << index)
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        self._free_units -= size
        if size > units:
            self._add_free(start + units, size - units)
        return start

    def release(self, start: int, units: int) -> None:
        """Return ``[start, start + units)``, merging it with free neighbours. The caller guarantees the
        range was reserved and not yet released (the host pool tracks live allocations)."""
        end = start + units
        right_size = self._by_start.get(end)
        if right_size is not None:
            self._remove_free(end, right_size)
            units += right_size
        left_start = self._by_end.get(start)
        if left_start is not None:
            left_size = self._by_start[left_start]
            self._remove_free(left_start, left_size)
            start = left_start
            units += left_size
        self._add_free(start, units)

    def _reserve_from_own_class(self, units: int) -> int | None:
        # Every class above the request's own one is empty, but the own class may still hold an extent
        # between ``units`` and its upper bound. Only reached when the space is nearly full; scanning here
        # keeps "fails iff no free extent is large enough" exact.
        index = size_class(units)
        for start in self._classes[index]:
            size = self._by_start[start]
            if size >= units:
                self._remove_free(start, size)
                if size > units:
                    self._add_free(start + units, size - units)
                return start
        return None

    def _add_free(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        index = size_class(size)
        self._classes[index][start] = None
        self._nonempty |= 1 << index
        self._free_units += size

    def _remove_free(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        index = size_class(size)
        members = self._classes[index]
        del members[start]
        if not members:
            self._nonempty &= ~(1 << index)
        self._free_units -= size
