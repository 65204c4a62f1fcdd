"""The registry of known-pinned host memory lives exactly as long as its owner."""

from __future__ import annotations

import gc

from kvferry.cuda.pinned import is_known_pinned, register_pinned


class _Owner:
    pass


def test_a_range_is_known_while_its_owner_lives() -> None:
    owner = _Owner()
    start = id(owner) << 20  # an address range nobody else registers
    assert not is_known_pinned(start)
    register_pinned(owner, start, 4096)
    assert is_known_pinned(start) and is_known_pinned(start + 4095)
    assert not is_known_pinned(start - 1) and not is_known_pinned(start + 4096)
    del owner
    gc.collect()
    assert not is_known_pinned(start)


def test_a_span_is_known_only_inside_one_registered_range() -> None:
    first, second = _Owner(), _Owner()
    start = id(first) << 20
    register_pinned(first, start, 4096)
    register_pinned(second, start + 4096, 4096)  # adjacent, but another allocation
    assert is_known_pinned(start, start + 4096)
    assert is_known_pinned(start + 4096, start + 8192)
    assert not is_known_pinned(start + 4000, start + 4200)  # would run across two allocations
    assert not is_known_pinned(start - 1, start + 10)
