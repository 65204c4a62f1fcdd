"""The few CUDA driver calls the transfer engine's hot path makes, through ctypes (libcuda, no compiler needed).

Why not torch: a pinned<->device `copy_` walks TensorIterator (10-20 us of CPU on the GPU machine's host), an
event record or stream wait through torch 3-5 us, a tensor view to address a slot a few more. One request is a
handful of these per slice, and that CPU time was the whole gap between one chunk's transfer and a bare memcpy.
A ctypes call into libcuda costs ~1 us. Streams and events stay interchangeable with torch's: a torch stream's
`cuda_stream` is the same CUstream, and handles made here wait on torch streams and vice versa.

Every call returns a CUresult; anything but success raises `CudaError` naming the call.

The calls that only enqueue or look (a launch, an async copy, an event record, wait or query, a flag write, the
current context) keep the GIL: ctypes otherwise releases it around each one, and in a process whose other threads
want it (the server's workers) each release hands it over, so a call of a few microseconds waited behind another
thread's Python for as long as that ran (H200, eight engines on one server: a third of the socket thread's time
in a transfer's enqueue was such waits). Calls that may block (a synchronize, registering host memory, creating
and destroying events) release it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

CUDA_ERROR_NOT_READY = 600
_EVENT_DISABLE_TIMING = 0x2  # timing-free events are the cheap kind: record/wait/query only
_SRC_ACCESS_ORDER_STREAM = 1  # a batched copy reads its source in stream order, like any async copy
_PREFER_OVERLAP_WITH_COMPUTE = 1  # ask for the copy engines: the SMs belong to the model
HOST_REGISTER_PORTABLE = 0x1  # registered for every context, not only the current one
HOST_REGISTER_DEVICEMAP = 0x2  # and given a device address (stream memory operations write there)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes_v1
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class Driver:
    """Bound libcuda entry points. One per process (`driver()`); safe to call from any thread."""

    def __init__(self, lib: Any, quick: Any) -> None:
        """`lib`: libcuda as a `ctypes.CDLL` (calls release the GIL); `quick`: the same as a `ctypes.PyDLL`."""
        c_void_p, c_size_t, c_uint64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
        self._lib = lib
        self._quick = quick
        self._name = lib.cuGetErrorName
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.dtoh = self._bind_quick("cuMemcpyDtoHAsync_v2", c_void_p, c_uint64, c_size_t, c_void_p)
        self.htod = self._bind_quick("cuMemcpyHtoDAsync_v2", c_uint64, c_void_p, c_size_t, c_void_p)
        self.record = self._bind_quick("cuEventRecord", c_void_p, c_void_p)
        self.wait = self._bind_quick("cuStreamWaitEvent", c_void_p, c_void_p, ctypes.c_uint)
        self.synchronize = self._bind("cuEventSynchronize", c_void_p)
        self._query = quick.cuEventQuery
        self._query.argtypes = [c_void_p]
        self._create = self._bind("cuEventCreate", ctypes.POINTER(c_void_p), ctypes.c_uint)
        self.destroy = self._bind("cuEventDestroy_v2", c_void_p)
        self.launch = self._bind_quick(
            "cuLaunchKernel", c_void_p, *[ctypes.c_uint] * 7, c_void_p, ctypes.POINTER(c_void_p), c_void_p
        )
        # Versioned entry points come and go between CUDA releases: the first this libcuda exports.
        names = ("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        write_value = next((n for n in names if hasattr(lib, n)), names[-1])
        self.write_value = self._bind_quick(write_value, c_void_p, c_uint64, ctypes.c_uint32, ctypes.c_uint)
        self.host_register = self._bind("cuMemHostRegister_v2", c_void_p, c_size_t, ctypes.c_uint)
        self.host_unregister = self._bind("cuMemHostUnregister", c_void_p)
        self._host_device_pointer = self._bind(
            "cuMemHostGetDevicePointer_v2", ctypes.POINTER(c_uint64), c_void_p, ctypes.c_uint
        )
        self._get_ctx = self._bind_quick("cuCtxGetCurrent", ctypes.POINTER(c_void_p))
        self._set_ctx = self._bind_quick("cuCtxSetCurrent", c_void_p)
        self._batch = self._bind_batch()
        self._batch_attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _Location(), _Location(),
                                              _PREFER_OVERLAP_WITH_COMPUTE)  # fmt: skip
        self._batch_first = ctypes.c_size_t(0)  # the one attribute set applies from copy 0 on

    def bind(self, name: str, *argtypes: Any, quick: bool = False) -> Any:
        """Another entry point, checked like these (`quick`: keeps the GIL, for calls that only enqueue)."""
        return self._bind_quick(name, *argtypes) if quick else self._bind(name, *argtypes)

    def _bind(self, name: str, *argtypes: Any, lib: Any = None) -> Any:
        fn = getattr(self._lib if lib is None else lib, name)
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
        fn.errcheck = self._errcheck
        return fn

    def _bind_quick(self, name: str, *argtypes: Any) -> Any:
        """A call that keeps the GIL (see the module)."""
        return self._bind(name, *argtypes, lib=self._quick)

    def _errcheck(self, result: int, fn: Any, args: tuple[Any, ...]) -> None:
        if result:
            text = ctypes.c_char_p()
            self._name(result, ctypes.byref(text))
            raise CudaError(f"{fn.__name__} failed: {(text.value or b'?').decode()} ({result})")

    def _bind_batch(self) -> Any:
        """cuMemcpyBatchAsync (CUDA 12.8+; the `_v2` of CUDA 13 drops the failure index), or None."""
        c_void_p, c_size_t, p_size = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)
        common = [c_void_p, c_void_p, c_void_p, c_size_t, ctypes.POINTER(_MemcpyAttributes), p_size, c_size_t]
        if hasattr(self._lib, "cuMemcpyBatchAsync_v2"):
            fn = self._bind_quick("cuMemcpyBatchAsync_v2", *common, c_void_p)
            return lambda d, s, n, count, a, i, stream: fn(d, s, n, count, a, i, 1, stream)
        if hasattr(self._lib, "cuMemcpyBatchAsync"):
            fn = self._bind_quick("cuMemcpyBatchAsync", *common, p_size, c_void_p)
            failed = ctypes.c_size_t()
            return lambda d, s, n, count, a, i, stream: fn(d, s, n, count, a, i, 1, ctypes.byref(failed), stream)
        return None

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
        """Several async copies (any direction, pinned host or device) in stream order as one call: the copy
        engine takes them as one batch instead of one operation each (only where `has_batch`)."""
        n = len(sizes)
        addresses = ctypes.c_uint64 * n
        self._batch(addresses(*dsts), addresses(*srcs), (ctypes.c_size_t * n)(*sizes), n,
                    ctypes.byref(self._batch_attrs), ctypes.byref(self._batch_first), stream)  # fmt: skip

    def copy_pages(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """`copy_batch` for copies already laid out as contiguous uint64 arrays (`kvferry.kernels.page_dma`, or
        built once ahead by a caller that copies the same pages again): the driver reads them in place, so a batch
        of thousands of pages costs no Python per page."""
        n = len(sizes)
        if not (len(dsts) == len(srcs) == n) or any(a.dtype != np.uint64 or not a.flags.c_contiguous
                                                      for a in (dsts, srcs, sizes)):  # fmt: skip
            raise ValueError("copy_pages takes three contiguous uint64 arrays of one length")
        self._batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n,
                    ctypes.byref(self._batch_attrs), ctypes.byref(self._batch_first), stream)  # fmt: skip

    def event(self) -> int:
        """A new timing-free event; the caller destroys it (`destroy`)."""
        handle = ctypes.c_void_p()
        self._create(ctypes.byref(handle), _EVENT_DISABLE_TIMING)
        return int(handle.value or 0)

    def host_device_pointer(self, host: int) -> int:
        """The device address of host memory registered with `host_register(..., DEVICEMAP)`."""
        address = ctypes.c_uint64()
        self._host_device_pointer(ctypes.byref(address), host, 0)
        return address.value

    def query(self, event: int) -> bool:
        """True once everything recorded before the event has run."""
        result = self._query(event)
        if result == CUDA_ERROR_NOT_READY:
            return False
        if result:
            self._errcheck(result, self._query, (event,))
        return True

    def param_sizes(self, function: int) -> list[int] | None:
        """Byte size of each parameter of a loaded kernel (None where the driver cannot say: before CUDA 12.4)."""
        info = getattr(self._lib, "cuFuncGetParamInfo", None)
        if info is None:
            return None
        info.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        info.restype = ctypes.c_int
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        sizes: list[int] = []
        while info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size)) == 0:
            sizes.append(size.value)
        return sizes

    def current_context(self) -> int:
        handle = ctypes.c_void_p()
        self._get_ctx(ctypes.byref(handle))
        return int(handle.value or 0)

    def current(self, context: int) -> _Current:
        """`with driver.current(ctx):` makes `ctx` current on this thread for the block (if it is not already),
        then restores the old one. (A class, not a generator: it runs several times per request.)"""
        return _Current(self, context)


class _Current:
    __slots__ = ("_context", "_driver", "_previous")

    def __init__(self, drv: Driver, context: int) -> None:
        self._driver = drv
        self._context = context
        self._previous = context

    def __enter__(self) -> None:
        self._previous = self._driver.current_context()
        if self._previous != self._context:
            self._driver._set_ctx(self._context)

    def __exit__(self, *exc: object) -> None:
        if self._previous != self._context:
            self._driver._set_ctx(self._previous or None)


def primary_context(device: Any) -> int:
    """The context torch runs on on CUDA `device` (its primary context). A runtime call on the device first (a
    stream query: it waits for nothing): a thread that never made one has no context current, even with the device
    selected."""
    import torch

    with torch.cuda.device(device):
        torch.cuda.current_stream(device).query()
        context = driver().current_context()
    if not context:
        raise CudaError(f"no CUDA context is current on {device} after a runtime call there")
    return context


@cache
def driver() -> Driver:
    """The process's driver bindings (loads libcuda.so.1, which torch has already loaded)."""
    return Driver(ctypes.CDLL("libcuda.so.1"), ctypes.PyDLL("libcuda.so.1"))
