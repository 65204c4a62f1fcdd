"""The host memory pool: one aligned (pinned when CUDA is available) slab, carved into typed tensor views.

Chunk objects of any shape and dtype live side by side in the slab. Every allocation starts on an
``alignment`` boundary and reserves its size rounded up to the alignment, so a reservation is one run of
alignment-sized units handed out by an :class:`~kvferry.memory.extent_allocator.ExtentAllocator`.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvferry.cuda.pinned import register_host_memory, register_pinned
from kvferry.memory.extent_allocator import ExtentAllocator
from kvferry.memory.slab import SharedSlab, aligned_slab, checked_layout, shared_slab

_MIN_ALIGNMENT = 64
_MAX_VIEWS = 4096  # carved views remembered (see HostPool._views)


class PoolFullError(MemoryError):
    """No free extent of the pool is large enough for a request; the message gives the numbers."""

    def __init__(
        self,
        what: str,
        requested_bytes: int,
        reserved_bytes: int,
        free_bytes: int,
        largest_free_bytes: int,
        capacity_bytes: int,
    ) -> None:
        self.requested_bytes = requested_bytes
        self.reserved_bytes = reserved_bytes
        self.free_bytes = free_bytes
        self.largest_free_bytes = largest_free_bytes
        self.capacity_bytes = capacity_bytes
        fragmented = " (enough bytes are free, but not in one extent)" if free_bytes >= reserved_bytes else ""
        super().__init__(
            f"host pool full: cannot allocate {what}: requested {requested_bytes:,} bytes "
            f"({reserved_bytes:,} with alignment), free {free_bytes:,} of {capacity_bytes:,} bytes, "
            f"largest free extent {largest_free_bytes:,} bytes{fragmented}"
        )


_new_tuple = tuple.__new__  # a NamedTuple from its fields without its __new__'s keyword handling


class Allocation(NamedTuple):
    """Where one live allocation sits in the slab."""

    offset: int  # byte offset of its first byte in the slab (a multiple of the alignment)
    requested_bytes: int  # bytes of the tensor view
    reserved_bytes: int  # bytes taken from the pool: requested_bytes rounded up to the alignment


class HostPool:
    """A fixed-size host memory pool that hands out contiguous tensor views of one slab.

    Allocation and free are O(1) (see ``ExtentAllocator``), exact in their accounting and thread-safe.
    An allocation is identified by its tensor's ``data_ptr()``: ``free`` accepts the returned tensor or
    any view of it that starts at its first byte. A freed view must not be used (nor changed in place: a later
    allocation at the same offset, shape and dtype may be handed the same tensor object). ``populate`` maps every
    page of an unpinned slab up front (a cache's pool: its stores then never fault).
    """

    def __init__(
        self,
        capacity_bytes: int,
        alignment: int = 4096,
        pin: bool | None = None,
        populate: bool = False,
        shared: bool = False,
    ) -> None:
        """``shared``: the slab is a memfd (`shared_slab`) that engines of this user on this host map to read
        located objects themselves (`shared_file`); pinned by registering it with the CUDA driver."""
        if not _is_int(alignment) or alignment < _MIN_ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"alignment={alignment!r} must be a power of two >= {_MIN_ALIGNMENT}")
        if not _is_int(capacity_bytes) or capacity_bytes <= 0 or capacity_bytes % alignment:
            raise ValueError(
                f"capacity_bytes={capacity_bytes!r} must be a positive multiple of alignment={alignment}"
                + (
                    f" (e.g. {capacity_bytes - capacity_bytes % alignment:,})"
                    if _is_int(capacity_bytes) and capacity_bytes > alignment
                    else ""
                )
            )
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        elif pin and not cuda:
            raise ValueError("pin=True needs CUDA, but torch.cuda.is_available() is False; pass pin=None")
        self._capacity_bytes = capacity_bytes
        self._alignment = alignment
        self._unit_shift = alignment.bit_length() - 1
        self._is_pinned = bool(pin)
        self._shared: SharedSlab | None = None
        if shared:
            if alignment > mmap.PAGESIZE:
                raise ValueError(f"alignment={alignment} exceeds a page ({mmap.PAGESIZE}): a shared slab is mapped")
            self._shared = shared_slab(capacity_bytes)
            self._slab = self._shared.tensor
            weakref.finalize(self, os.close, self._shared.fd)  # with the pool (the mapping needs no descriptor)
            if self._is_pinned:
                register_host_memory(self, self._slab.data_ptr(), capacity_bytes)
        else:
            self._slab = aligned_slab(capacity_bytes, alignment, self._is_pinned)
        self._base_ptr = self._slab.data_ptr()
        if self._is_pinned:  # the slab lives at least as long as the pool
            register_pinned(self, self._base_ptr, capacity_bytes)
        elif populate:
            # An unpinned slab's pages are mapped on first touch: a store into fresh pool memory pays a page fault
            # per 4 KiB (16 chunks of qwen: 16 ms instead of 5 on the CPU machine). Pinning touches every page.
            self._slab.zero_()
        # as_strided takes an absolute storage offset, and the slab may start past its storage's start (the
        # alignment padding). Both are multiples of the alignment (>= 64), hence of any dtype's itemsize.
        self._slab_storage_offset = self._slab.storage_offset()
        # The slab viewed as each dtype seen so far: carving a view is then one as_strided call, a few
        # times cheaper than slicing and re-viewing the uint8 slab on every allocation.
        self._typed_slabs: dict[torch.dtype, torch.Tensor] = {}
        # Views already carved, by (offset, shape, dtype): a cache allocates the same few shapes at the same few
        # offsets over and over, and handing out the same view again costs a dict lookup instead of an as_strided
        # call (~3 us, a tenth of a store's bookkeeping). Views hold no memory of their own; bounded anyway.
        self._views: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._extents = ExtentAllocator(capacity_bytes >> self._unit_shift)
        self._live: dict[int, Allocation] = {}  # data_ptr -> allocation
        self._requested_bytes = 0
        self._lock = threading.Lock()
        self._layouts: dict[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], list[int], int]] = {}

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape``/``dtype`` view into the slab; raises PoolFullError when nothing fits."""
        tensor = self._alloc(shape, dtype, raise_when_full=True)
        assert tensor is not None
        return tensor

    def try_alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """Like ``alloc`` but returns None when full (invalid arguments still raise)."""
        return self._alloc(shape, dtype, raise_when_full=False)

    def free(self, tensor: torch.Tensor) -> None:
        """Return the allocation that starts at ``tensor.data_ptr()``; ValueError if there is none."""
        self.free_address(tensor.data_ptr())

    def allocation(self, tensor: torch.Tensor) -> Allocation:
        """The live allocation that starts at ``tensor.data_ptr()``; ValueError if there is none."""
        ptr = tensor.data_ptr()
        allocation = self._live.get(ptr)
        if allocation is None:
            raise ValueError(f"allocation: {self._describe_unknown(ptr)}")
        return allocation

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element in the slab (any view into the slab is accepted)."""
        offset = tensor.data_ptr() - self._base_ptr
        if tensor.device.type != "cpu" or not 0 <= offset < self._capacity_bytes:
            raise ValueError(
                f"offset_of: tensor (device={tensor.device}, data_ptr={tensor.data_ptr():#x}) is not inside "
                f"this pool's slab [{self._base_ptr:#x}, {self._base_ptr + self._capacity_bytes:#x})"
            )
        return offset

    @property
    def slab(self) -> torch.Tensor:
        """The whole slab as a 1-D uint8 tensor of ``capacity_bytes`` bytes, starting aligned."""
        return self._slab

    @property
    def shared_fd(self) -> int | None:
        """This process's descriptor of a shared slab's memfd (None: the slab is private)."""
        return None if self._shared is None else self._shared.fd

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def is_pinned(self) -> bool:
        return self._is_pinned

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live allocations (each rounded up to the alignment)."""
        return self._capacity_bytes - (self._extents.free_units << self._unit_shift)

    @property
    def requested_bytes(self) -> int:
        """Bytes requested by live allocations, before rounding to the alignment."""
        return self._requested_bytes

    @property
    def free_bytes(self) -> int:
        return self._extents.free_units << self._unit_shift

    @property
    def largest_free_bytes(self) -> int:
        """The largest allocation (in bytes, alignment included) that would succeed now."""
        with self._lock:
            return self._extents.largest_free_units << self._unit_shift

    @property
    def num_allocations(self) -> int:
        return len(self._live)

    @property
    def num_free_extents(self) -> int:
        """Number of separate free ranges; at most ``num_allocations + 1`` since free neighbours merge."""
        return self._extents.num_free_extents

    def stats(self) -> dict[str, int | float | bool]:
        """A consistent snapshot of the pool's accounting, for logs and metrics."""
        with self._lock:
            free = self._extents.free_units << self._unit_shift
            largest = self._extents.largest_free_units << self._unit_shift
            used = self._capacity_bytes - free
            return {
                "capacity_bytes": self._capacity_bytes,
                "used_bytes": used,
                "requested_bytes": self._requested_bytes,
                "alignment_waste_bytes": used - self._requested_bytes,
                "free_bytes": free,
                "largest_free_bytes": largest,
                "num_allocations": len(self._live),
                "num_free_extents": self._extents.num_free_extents,
                "utilization": used / self._capacity_bytes,
                # Share of the free bytes that a single allocation cannot use: 0.0 means one free extent.
                "fragmentation": 1.0 - largest / free if free else 0.0,
                "alignment": self._alignment,
                "is_pinned": self._is_pinned,
            }

    def __repr__(self) -> str:
        return (
            f"HostPool(capacity_bytes={self._capacity_bytes:,}, used_bytes={self.used_bytes:,}, "
            f"num_allocations={len(self._live)}, alignment={self._alignment}, pinned={self._is_pinned})"
        )

    def _alloc(self, shape: Sequence[int], dtype: torch.dtype, raise_when_full: bool) -> torch.Tensor | None:
        dims, strides, nbytes = self._layout(shape, dtype)
        units = self._units(nbytes)
        with self._lock:
            offset = self._reserve_locked(units, nbytes)
            if offset is None:
                if not raise_when_full:
                    return None
                raise PoolFullError(
                    f"shape={dims} dtype={dtype}",
                    requested_bytes=nbytes,
                    reserved_bytes=units << self._unit_shift,
                    free_bytes=self._extents.free_units << self._unit_shift,
                    largest_free_bytes=self._extents.largest_free_units << self._unit_shift,
                    capacity_bytes=self._capacity_bytes,
                )
        return self._carve([offset], dims, strides, dtype)[0]

    def try_alloc_many(self, shape: Sequence[int], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """Up to ``count`` views like ``try_alloc``'s, fewer (maybe none) once the pool is full.

        One layout check and one lock for all of them (a store of many chunks allocates its objects here), and
        one run of adjacent objects when a free extent holds them all: the GPU path then moves them with one DMA
        per slice instead of one per object. Each is still its own allocation, freed on its own.
        """
        dims, strides, nbytes = self._layout(shape, dtype)
        offsets, run = self._reserve_many(nbytes, count)
        step = self._units(nbytes) << self._unit_shift if run else None
        return self._carve(offsets, dims, strides, dtype, step)

    def try_reserve_many(self, shape: Sequence[int], dtype: torch.dtype, count: int) -> list[int]:
        """``try_alloc_many`` without the views: the allocations' addresses, for a caller that hands them to a copy
        before it needs tensors (carving views touches torch; a store's path to its first GPU operation is kept
        short). ``views`` carves them later; each is freed with ``free_address`` or ``free``."""
        offsets, _ = self._reserve_many(self._layout(shape, dtype)[2], count)
        return [self._base_ptr + offset for offset in offsets]

    def allocation_bytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The pool bytes an object of ``shape``/``dtype`` takes (its size rounded up to the alignment)."""
        return self._units(self._layout(shape, dtype)[2]) << self._unit_shift

    def views(self, addresses: Sequence[int], shape: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """Views of ``shape``/``dtype`` at live allocations' ``addresses`` (from ``try_reserve_many``)."""
        dims, strides, nbytes = self._layout(shape, dtype)
        offsets = []
        for address in addresses:
            allocation = self._live.get(address)
            if allocation is None or allocation.requested_bytes != nbytes:
                raise ValueError(f"views: no live allocation of {nbytes:,} bytes at {address:#x}")
            offsets.append(allocation.offset)
        return self._views_at(offsets, dims, strides, dtype)

    def shrink_to(self, address: int, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Make the live allocation at ``address`` hold an object of ``shape``/``dtype`` (no larger than it), giving
        the units past it back: a slot reserved for a whole chunk that was written with a shorter object (a tail)."""
        nbytes = self._layout(shape, dtype)[2]
        units = self._units(nbytes)
        with self._lock:
            allocation = self._live.get(address)
            if allocation is None or allocation.reserved_bytes < units << self._unit_shift:
                raise ValueError(f"shrink_to: no live allocation of at least {nbytes:,} bytes at {address:#x}")
            spare_units = (allocation.reserved_bytes >> self._unit_shift) - units
            if spare_units:
                self._extents.release((allocation.offset >> self._unit_shift) + units, spare_units)
            self._live[address] = Allocation(allocation.offset, nbytes, units << self._unit_shift)
            self._requested_bytes += nbytes - allocation.requested_bytes

    def free_address(self, address: int) -> None:
        """``free`` by the allocation's address (from ``try_reserve_many``)."""
        with self._lock:
            allocation = self._live.pop(address, None)
            if allocation is not None:
                self._give_back(allocation)
                return
        raise ValueError(f"free: {self._describe_unknown(address)}")

    def _units(self, nbytes: int) -> int:
        """The allocation units ``nbytes`` take (rounded up to the alignment)."""
        return (nbytes + self._alignment - 1) >> self._unit_shift

    def _reserve_many(self, nbytes: int, count: int) -> tuple[list[int], bool]:
        """Up to ``count`` reservations of ``nbytes`` (slab offsets); True if they are one run back to back."""
        units = self._units(nbytes)
        offsets: list[int] = []
        with self._lock:
            run = self._extents.reserve(units * count) if count > 1 else None
            if run is not None:  # one run: its records made in one pass, on a store's path to its first DMA
                step, start, base = units << self._unit_shift, run << self._unit_shift, self._base_ptr
                offsets = list(range(start, start + count * step, step))
                self._live.update({base + o: _new_tuple(Allocation, (o, nbytes, step)) for o in offsets})
                self._requested_bytes += count * nbytes
            else:
                for _ in range(count):
                    reserved = self._reserve_locked(units, nbytes)
                    if reserved is None:
                        break
                    offsets.append(reserved)
        return offsets, run is not None

    def _reserve_locked(self, units: int, nbytes: int) -> int | None:
        unit = self._extents.reserve(units)
        if unit is None:
            return None
        offset = unit << self._unit_shift
        self._live[self._base_ptr + offset] = Allocation(offset, nbytes, units << self._unit_shift)
        self._requested_bytes += nbytes
        return offset

    def _carve(
        self,
        offsets: list[int],
        dims: tuple[int, ...],
        strides: list[int],
        dtype: torch.dtype,
        step: int | None = None,
    ) -> list[torch.Tensor]:
        """``_views_at`` for reservations just made: if carving fails or is interrupted, none stays reserved."""
        try:
            return self._views_at(offsets, dims, strides, dtype, step)
        except BaseException:
            with self._lock:
                for offset in offsets:
                    self._give_back(self._live.pop(self._base_ptr + offset))
            raise

    def _views_at(
        self, offsets: list[int], dims: tuple[int, ...], strides: list[int], dtype: torch.dtype, step: int | None = None
    ) -> list[torch.Tensor]:
        """Views at reserved ``offsets`` (``step`` bytes apart, if given: then one strided view, unbound, which
        costs half as much per object)."""
        typed = self._typed_slabs.get(dtype)
        if typed is None:
            typed = self._typed_slabs.setdefault(dtype, self._slab.view(dtype))
        base, size = self._slab_storage_offset, dtype.itemsize
        if step is not None and offsets:
            run = typed.as_strided((len(offsets), *dims), (step // size, *strides), (base + offsets[0]) // size)
            return list(run.unbind(0))
        views = self._views
        out = []
        for offset in offsets:
            view = views.get((offset, dims, dtype))
            if view is None:
                view = typed.as_strided(dims, strides, (base + offset) // size)
                if len(views) >= _MAX_VIEWS:
                    views.clear()
                views[(offset, dims, dtype)] = view
            out.append(view)
        return out

    def _layout(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[tuple[int, ...], list[int], int]:
        """``_checked_layout``, remembered per (shape, dtype): a cache allocates the same few shapes forever."""
        key = (shape, dtype) if type(shape) is tuple else None
        layout = self._layouts.get(key) if key is not None else None
        if layout is None:
            layout = checked_layout(shape, dtype)
            if key is not None and len(self._layouts) < 64:
                self._layouts[key] = layout
        return layout

    def _give_back(self, allocation: Allocation) -> None:
        # Caller holds the lock and has removed the allocation from self._live.
        self._extents.release(allocation.offset >> self._unit_shift, allocation.reserved_bytes >> self._unit_shift)
        self._requested_bytes -= allocation.requested_bytes

    def _describe_unknown(self, ptr: int) -> str:
        offset = ptr - self._base_ptr
        if 0 <= offset < self._capacity_bytes:
            return (
                f"tensor at slab offset {offset:,} is not a live allocation of this pool "
                "(already freed, or a view that does not start where an allocation starts)"
            )
        return f"tensor (data_ptr={ptr:#x}) does not point into this pool's slab"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
