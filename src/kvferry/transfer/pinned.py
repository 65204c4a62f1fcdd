"""Host memory known to be pinned, so the GPU path's check needs no CUDA query (~5-15 us per request otherwise).

Owners of long-lived pinned slabs (the host pool) register the slab's storage for as long as they live; the
transfer path asks `is_known_pinned` first and `Tensor.is_pinned()` only for memory nobody registered.
"""

from __future__ import annotations

import weakref

_storages: dict[int, None] = {}  # storage addresses of registered pinned slabs


def register_pinned(owner: object, storage_ptr: int) -> None:
    """Record `storage_ptr` (an `untyped_storage().data_ptr()`) as pinned until `owner` is collected; the owner must
    keep that storage alive at least as long as itself."""
    _storages[storage_ptr] = None
    weakref.finalize(owner, _storages.pop, storage_ptr, None)


def is_known_pinned(storage_ptr: int) -> bool:
    return storage_ptr in _storages
