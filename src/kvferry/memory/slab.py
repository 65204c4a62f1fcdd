"""The slab behind a `HostPool`, and the layout of the tensors carved from it."""

from __future__ import annotations

import operator
from collections.abc import Sequence

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
