"""Device memory allocated the way vLLM 0.34's extensible KV cache allocates it when a connector declares
``EXPORTS_FD`` (``vllm/v1/worker/extensible_kv_cache.py`` through ``vllm/utils/vmm_driver.py``): one address range
reserved (``cuMemAddressReserve``), each segment backed by one physical allocation (``cuMemCreate``: pinned device
memory, the POSIX-fd handle type requested) mapped into it (``cuMemMap``) and made read-write for the device
(``cuMemSetAccess``). Sleep releases the physical memory (unmap, release) and keeps the range; wake maps new
allocations at the same addresses, their contents undefined.

For benchmarks and tests that need the engine's KV memory as vLLM makes it, without vLLM.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

from kvferry.cuda.driver import driver, primary_context
from kvferry.cuda.vmm import HANDLE_TYPE_POSIX_FD, AccessDesc, AllocationProp, Location, calls

_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1
_ACCESS_READ_WRITE = 3
_GRANULARITY_MINIMUM = 0


class DriverMappedSegments:
    """Segments of at least `segment_bytes` each (rounded up to the driver's granularity), back to back in one
    reserved range on CUDA device `device` (an index). `tensor()` is the whole range as uint8. `handle_types`: the
    shareable handle types the allocations are created with (vLLM's without a connector that exports: none)."""

    def __init__(self, segment_bytes: list[int], device: int, handle_types: int = HANDLE_TYPE_POSIX_FD) -> None:
        self.device = device
        self._context = primary_context(device)
        self._prop = AllocationProp()
        self._prop.type = _ALLOCATION_PINNED
        self._prop.requestedHandleTypes = handle_types
        self._prop.location = Location(_LOCATION_DEVICE, device)
        granule = ctypes.c_size_t()
        with driver().current(self._context):
            calls().granularity(ctypes.byref(granule), ctypes.byref(self._prop), _GRANULARITY_MINIMUM)
            self.granularity = granule.value
            self.sizes = [-(-max(n, 1) // granule.value) * granule.value for n in segment_bytes]
            self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
            self.nbytes = sum(self.sizes)
            base = ctypes.c_uint64()
            calls().reserve(ctypes.byref(base), self.nbytes, 0, 0, 0)
        self.address = base.value
        self._handles: list[int] = []
        # Freed once garbage (a tensor over the range holds this object) or by `free`, whichever comes first.
        self._free = weakref.finalize(
            self, _free, self._context, self.address, self.nbytes, self.offsets, self.sizes, self._handles
        )
        self.__cuda_array_interface__ = {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.address, False),
            "strides": None,
            "version": 3,
        }
        self.commit()

    @property
    def committed(self) -> bool:
        return bool(self._handles)

    def commit(self) -> None:
        """Back every segment with a new physical allocation (what vLLM does at start and on wake)."""
        if self._handles:
            raise RuntimeError("the segments are backed already")
        c = calls()
        access = AccessDesc(Location(_LOCATION_DEVICE, self.device), _ACCESS_READ_WRITE)
        with driver().current(self._context):
            try:
                for offset, size in zip(self.offsets, self.sizes, strict=True):
                    handle = ctypes.c_uint64()
                    c.create(ctypes.byref(handle), size, ctypes.byref(self._prop), 0)
                    try:
                        c.map(self.address + offset, size, 0, handle.value, 0)
                    except BaseException:
                        c.release(handle.value)
                        raise
                    self._handles.append(handle.value)
                    c.set_access(self.address + offset, size, ctypes.byref(access), 1)
            except BaseException:
                self.release_physical()
                raise

    def release_physical(self) -> None:
        """Unmap and release every segment's allocation (what vLLM does at sleep); the range stays reserved.
        The caller has synchronized every stream that touches the memory."""
        _release(self._context, self.address, self.offsets, self.sizes, self._handles)

    def free(self) -> None:
        """Release the memory and the range now; no view may be used after this."""
        self._free()

    def tensor(self) -> Any:
        """The whole range as a uint8 tensor (it keeps this object alive; the memory is what is committed)."""
        import torch

        return torch.as_tensor(self, device=torch.device("cuda", self.device))


def _release(context: int, address: int, offsets: list[int], sizes: list[int], handles: list[int]) -> None:
    c = calls()
    with driver().current(context):
        for offset, size, handle in zip(offsets, sizes, handles, strict=False):
            c.unmap(address + offset, size)
            c.release(handle)
    handles.clear()


def _free(context: int, address: int, nbytes: int, offsets: list[int], sizes: list[int], handles: list[int]) -> None:
    _release(context, address, offsets, sizes, handles)
    with driver().current(context):
        calls().free(address, nbytes)
