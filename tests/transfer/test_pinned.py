"""The registry of known-pinned host memory lives exactly as long as its owner."""

from __future__ import annotations

import gc

from kvferry.transfer.pinned import is_known_pinned, register_pinned


class _Owner:
    pass


def test_registration_ends_with_its_owner() -> None:
    owner = _Owner()
    address = id(owner) << 4  # any address nobody else registers
    assert not is_known_pinned(address)
    register_pinned(owner, address)
    assert is_known_pinned(address)
    del owner
    gc.collect()
    assert not is_known_pinned(address)
