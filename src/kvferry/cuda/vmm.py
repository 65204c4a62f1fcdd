"""Driver-mapped (VMM) device memory shared by POSIX file descriptor: the engine's side exports the physical
allocation behind a device pointer, the server's side imports it and maps the same pages into its own address space.

Why: vLLM 0.34's extensible KV cache reserves an address range and maps physical allocations into it with the
driver's VMM calls (``cuMemCreate`` / ``cuMemMap``). Legacy CUDA IPC (``cudaIpcGetMemHandle``) cannot export such
memory; an allocation created with the POSIX-fd handle type can be exported as a file descriptor
(``cuMemExportToShareableHandle``), which another process of the same user receives over a Unix socket
(SCM_RIGHTS) and imports (``cuMemImportFromShareableHandle``). Each exported allocation is mapped whole; tensors are
views at their offset in it.

Every failing call raises `CudaError` naming the call and the driver's error name (`kvferry.cuda.driver`).
"""

from __future__ import annotations

import ctypes
import os
import socket
import weakref
from dataclasses import dataclass
from functools import cache
from typing import Any

from kvferry.cuda.driver import CudaError, driver

HANDLE_TYPE_POSIX_FD = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_POINTER_IS_LEGACY_IPC_CAPABLE = 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
# The entry points both sides need; a libcuda without one of them cannot share VMM memory.
_ENTRY_POINTS = (
    "cuPointerGetAttribute",
    "cuMemGetAddressRange_v2",
    "cuMemRetainAllocationHandle",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemAddressReserve",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemAddressFree",
    "cuMemRelease",
)


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def fd_export_unavailable_reason() -> str | None:
    """Why this process cannot share VMM memory by file descriptor (None: it can). Loads libcuda only: no CUDA
    context is made, so it answers in a process that never touches the GPU (vLLM's front end)."""
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "file descriptors pass between processes over Unix sockets on Linux only"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the CUDA driver (libcuda.so.1) does not load: {exc}"
    missing = [name for name in _ENTRY_POINTS if not hasattr(lib, name)]
    if missing:
        return f"this CUDA driver lacks {', '.join(missing)}"
    return None


class _Calls:
    """The VMM entry points, bound like the rest of `kvferry.cuda.driver` (errors name the call)."""

    def __init__(self) -> None:
        drv = driver()
        u64, size_t, p_u64 = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)
        self.pointer_attribute = drv.bind("cuPointerGetAttribute", ctypes.c_void_p, ctypes.c_int, u64)
        self.address_range = drv.bind("cuMemGetAddressRange_v2", p_u64, ctypes.POINTER(size_t), u64)
        self.retain = drv.bind("cuMemRetainAllocationHandle", p_u64, u64)
        self.properties = drv.bind("cuMemGetAllocationPropertiesFromHandle", ctypes.POINTER(AllocationProp), u64)
        self.export = drv.bind("cuMemExportToShareableHandle", ctypes.c_void_p, u64, ctypes.c_int, ctypes.c_ulonglong)
        self.import_ = drv.bind("cuMemImportFromShareableHandle", p_u64, ctypes.c_void_p, ctypes.c_int)
        self.granularity = drv.bind(
            "cuMemGetAllocationGranularity", ctypes.POINTER(size_t), ctypes.POINTER(AllocationProp), ctypes.c_int
        )
        self.reserve = drv.bind("cuMemAddressReserve", p_u64, size_t, size_t, u64, ctypes.c_ulonglong)
        self.map = drv.bind("cuMemMap", u64, size_t, size_t, u64, ctypes.c_ulonglong)
        self.set_access = drv.bind("cuMemSetAccess", u64, size_t, ctypes.POINTER(AccessDesc), size_t)
        self.unmap = drv.bind("cuMemUnmap", u64, size_t)
        self.free = drv.bind("cuMemAddressFree", u64, size_t)
        self.release = drv.bind("cuMemRelease", u64)
        self.create = drv.bind("cuMemCreate", p_u64, size_t, ctypes.POINTER(AllocationProp), ctypes.c_ulonglong)


@cache
def calls() -> _Calls:
    return _Calls()


def is_legacy_ipc_capable(address: int) -> bool:
    """Whether `cudaIpcGetMemHandle` can export the memory at device address `address` (cudaMalloc'd memory);
    driver-mapped memory is not."""
    capable = ctypes.c_int(0)
    calls().pointer_attribute(ctypes.byref(capable), _POINTER_IS_LEGACY_IPC_CAPABLE, address)
    return bool(capable.value)


@dataclass(frozen=True, slots=True)
class ExportedAllocation:
    """The physical allocation mapped at [base, base + nbytes) in the exporting process, as a descriptor the
    caller owns (and closes once it has been sent)."""

    base: int
    nbytes: int
    fd: int


def allocation_range(address: int) -> tuple[int, int]:
    """(base, bytes) of the allocation mapped at device address `address`."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    calls().address_range(ctypes.byref(base), ctypes.byref(size), address)
    return base.value, size.value


def export_allocation(address: int) -> ExportedAllocation:
    """Export the physical allocation backing device address `address` as a POSIX file descriptor."""
    c = calls()
    base, size = allocation_range(address)
    handle = ctypes.c_uint64()
    c.retain(ctypes.byref(handle), base)  # fails for memory the VMM calls did not map
    try:
        prop = AllocationProp()
        c.properties(ctypes.byref(prop), handle.value)
        if not prop.requestedHandleTypes & HANDLE_TYPE_POSIX_FD:
            raise CudaError(
                f"the allocation at {base:#x} was created without the POSIX file descriptor handle type "
                f"(its handle types: {prop.requestedHandleTypes:#x}), so no other process can import it"
            )
        fd = ctypes.c_int(-1)
        c.export(ctypes.byref(fd), handle.value, HANDLE_TYPE_POSIX_FD, 0)
    finally:
        c.release(handle.value)  # the retain's reference; the engine's own keeps the memory
    return ExportedAllocation(base, size, fd.value)


class ImportedAllocation:
    """Another process's allocation, imported from its file descriptor and mapped read-write on `device` here.
    `address` is where its bytes start; the mapping ends once this object is garbage (`weakref.finalize`): a torch
    tensor viewing it (`__cuda_array_interface__`) holds it, so it lasts as long as any view does."""

    def __init__(self, fd: int, nbytes: int, device: int, context: int) -> None:
        """`fd` stays the caller's to close. `context`: the device's primary context, current for the calls."""
        c = calls()
        drv = driver()
        self.nbytes = nbytes
        self.device = device
        with drv.current(context):
            handle = ctypes.c_uint64()
            c.import_(ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_TYPE_POSIX_FD)
            try:
                prop = AllocationProp()
                c.properties(ctypes.byref(prop), handle.value)
                # Its device is the one the client named by UUID (`device`, this process's ordinal); the ordinal
                # in the properties may count in the exporter's CUDA_VISIBLE_DEVICES, so only its kind is checked.
                if prop.location.type != _LOCATION_DEVICE:
                    raise CudaError(
                        f"the imported allocation is not device memory (location type {prop.location.type})"
                    )
                granule = ctypes.c_size_t()
                c.granularity(ctypes.byref(granule), ctypes.byref(prop), _GRANULARITY_MINIMUM)
                if nbytes <= 0 or nbytes % granule.value:
                    raise CudaError(f"{nbytes} bytes is not a whole number of {granule.value}-byte granules")
                address = ctypes.c_uint64()
                c.reserve(ctypes.byref(address), nbytes, 0, 0, 0)
                try:
                    c.map(address.value, nbytes, 0, handle.value, 0)  # the driver refuses more than the allocation
                    try:
                        access = AccessDesc(Location(_LOCATION_DEVICE, device), _ACCESS_READ_WRITE)
                        c.set_access(address.value, nbytes, ctypes.byref(access), 1)
                    except BaseException:
                        c.unmap(address.value, nbytes)
                        raise
                except BaseException:
                    c.free(address.value, nbytes)
                    raise
            finally:
                c.release(handle.value)  # the mapping holds the memory from here; unmapping frees it
        self.address = address.value
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.address, False),
            "strides": None,
            "version": 3,
        }
        self._unmap = weakref.finalize(self, _unmap, context, self.address, nbytes)

    def unmap(self) -> None:
        """Unmap now (no view may be used after this); garbage collection does it otherwise."""
        self._unmap()


def _unmap(context: int, address: int, nbytes: int) -> None:
    c = calls()
    with driver().current(context):
        c.unmap(address, nbytes)
        c.free(address, nbytes)


def as_byte_tensor(allocation: ImportedAllocation) -> Any:
    """A uint8 torch tensor over the whole mapped allocation; it keeps `allocation` (and so the mapping) alive."""
    import torch

    return torch.as_tensor(allocation, device=torch.device("cuda", allocation.device))
