"""The slab behind a `HostPool`, and the layout of the tensors carved from it."""

from __future__ import annotations

import mmap
import operator
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch


def checked_layout(shape: Sequence[int], dtype: torch.dtype) -> tuple[tuple[int, ...], list[int], int]:
    """``shape`` as a tuple of ints, its contiguous strides and the byte size of a ``shape``/``dtype``
    tensor; rejects empty ones."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} must be a torch.dtype")
    try:
        dims = tuple(map(operator.index, shape))
    except TypeError:
        raise TypeError(f"shape={shape!r} must be a sequence of ints") from None
    if min(dims, default=1) <= 0:
        raise ValueError(f"shape={dims} must have every dimension >= 1 (zero-size allocations are rejected)")
    strides = [1] * len(dims)
    numel = 1
    for axis in range(len(dims) - 1, -1, -1):
        strides[axis] = numel
        numel *= dims[axis]
    return dims, strides, numel * dtype.itemsize


def aligned_slab(capacity: int, alignment: int, pin: bool) -> torch.Tensor:
    raw = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
    if raw.data_ptr() % alignment == 0:
        return raw
    # Over-allocate and start at the first aligned byte. Only done when the exact-size allocation is not
    # aligned: torch's pinned allocator rounds every request up to a power of two, so padding a
    # power-of-two capacity up front would double the pinned memory.
    del raw
    raw = torch.empty(capacity + alignment, dtype=torch.uint8, pin_memory=pin)
    pad = -raw.data_ptr() % alignment
    return raw[pad : pad + capacity]


class SharedSlab(NamedTuple):
    """A slab in a memfd that other processes of this user map through ``/proc/<pid>/fd/<fd>``."""

    tensor: torch.Tensor  # the whole file as uint8, mapped MAP_SHARED here
    fd: int  # this process's descriptor of the file, open as long as the mapping lives
    mapping: mmap.mmap


def shared_slab(capacity: int, name: str = "kvferry-pool") -> SharedSlab:
    """A ``capacity``-byte memfd mapped here: page-aligned, so aligned for any pool alignment up to a page (a
    larger one is refused by the caller). Its pages are the file's: the kernel frees them when the last mapping
    and descriptor go, whichever process holds them last."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        mapping = mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return SharedSlab(torch.frombuffer(mapping, dtype=torch.uint8), fd, mapping)
