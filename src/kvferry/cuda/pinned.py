"""Host memory known to be pinned, so the GPU path's check needs no CUDA query (~5-15 us per object otherwise).

Owners of long-lived pinned slabs (the host pool) register the slab's address range for as long as they live;
the transfer path asks `is_known_pinned(start, end)` first (once for a request whose objects all lie in one slab)
and `Tensor.is_pinned()` only for memory nobody registered. An address inside a registered range can only belong to
that slab's allocation, which is pinned; so host ranges inside one registered range are one pinned allocation, and
one DMA may run across objects that sit back to back there.
"""

from __future__ import annotations

import weakref

_ranges: dict[int, int] = {}  # start -> end of each registered pinned slab


def register_pinned(owner: object, start: int, nbytes: int) -> None:
    """Record `[start, start + nbytes)` as pinned until `owner` is collected; the owner must keep that memory
    alive at least as long as itself."""
    _ranges[start] = start + nbytes
    weakref.finalize(owner, _ranges.pop, start, None)


def is_known_pinned(start: int, end: int | None = None) -> bool:
    """True if `[start, end)` (default: the one byte at `start`) lies inside one registered pinned slab."""
    end = start + 1 if end is None else end
    return any(lo <= start and end <= hi for lo, hi in _ranges.items())


def register_host_memory(owner: object, start: int, nbytes: int) -> None:
    """Page-lock `[start, start + nbytes)` (memory this process mapped itself: a shared file) for every CUDA context
    of this process until `owner` is collected, then unregister it; the owner keeps the mapping alive that long.
    Registering takes ~0.4 s a GiB of untouched memory (an H100 host); a RuntimeError if the driver refuses."""
    import torch

    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(start, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes:,} bytes at {start:#x} failed: {error}")
    weakref.finalize(owner, cudart.cudaHostUnregister, start)


_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every context, not only the current one
