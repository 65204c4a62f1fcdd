"""CUDA graphs through the driver (ctypes): capture a stream's work once, replay it with its host copies re-aimed.

Why: a one-chunk transfer is a gather (or scatter) kernel and a DMA per row range on two streams, each launched
from Python. As separate launches the copy engine idles between them and the enqueue costs 20-40 us of CPU; the
same work captured as one graph runs its pieces back to back on the GPU and costs one launch (H200: one 3 MiB
qwen2.5-0.5b store 0.78 of a memcpy as separate launches, 0.89-0.93 as a graph; llama3-8b 0.94 / 0.97-0.99).

A replay moves different bytes by re-aiming its host copies (`cuGraphExecMemcpyNodeSetParams`, ~1.5 us each: the
object's address changes per request) while its kernels keep the device tables they were captured with (the caller
rewrites those before each launch, on the stream the graph runs on).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

from kvferry.cuda.driver import Driver, driver

_CAPTURE_THREAD_LOCAL = 1  # only this thread's unsafe calls break the capture (other threads keep working)
_NODE_MEMCPY = 1
_HOST = 1  # CUmemorytype: the others (device, array, unified) address memory by a device pointer


class Memcpy3D(ctypes.Structure):
    """CUDA_MEMCPY3D: a graph memcpy node's parameters."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcZ", ctypes.c_size_t),
        ("srcLOD", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("reserved0", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("srcHeight", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstZ", ctypes.c_size_t),
        ("dstLOD", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("reserved1", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("dstHeight", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
        ("Depth", ctypes.c_size_t),
    ]


class GraphCalls:
    """The graph entry points of libcuda, bound once per process (`graph_calls()`)."""

    def __init__(self, drv: Driver) -> None:
        p, vp, size_t = ctypes.POINTER, ctypes.c_void_p, ctypes.c_size_t
        self.begin = drv.bind("cuStreamBeginCapture_v2", vp, ctypes.c_int)
        self.end = drv.bind("cuStreamEndCapture", vp, p(vp))
        self.instantiate = drv.bind("cuGraphInstantiateWithFlags", p(vp), vp, ctypes.c_ulonglong)
        self.launch = drv.bind("cuGraphLaunch", vp, vp, quick=True)
        self.nodes = drv.bind("cuGraphGetNodes", vp, p(vp), p(size_t))
        self.node_type = drv.bind("cuGraphNodeGetType", vp, p(ctypes.c_int))
        self.memcpy_params = drv.bind("cuGraphMemcpyNodeGetParams", vp, p(Memcpy3D))
        self.set_memcpy = drv.bind("cuGraphExecMemcpyNodeSetParams", vp, vp, p(Memcpy3D), vp, quick=True)
        self.destroy_graph = drv.bind("cuGraphDestroy", vp)
        self.destroy_exec = drv.bind("cuGraphExecDestroy", vp)


@cache
def graph_calls() -> GraphCalls:
    return GraphCalls(driver())


@dataclass
class HostCopy:
    """A captured copy between device memory and host memory, re-aimable per replay."""

    node: int
    params: Memcpy3D
    host_field: str  # which field of `params` holds the host address
    device_address: int  # where on the device it reads or writes (identifies the copy)
    params_ref: Any = None  # ctypes.byref(params), made once

    def __post_init__(self) -> None:
        self.params_ref = ctypes.byref(self.params)


class CapturedGraph:
    """Work captured from one stream (and the streams it forked to) as an instantiated graph.

    `with graph.capturing(stream):` enqueue the work on `stream` (other streams join by waiting on events recorded
    there and must be joined back before the block ends). Then `host_copies()` finds the copies to re-aim, and
    `launch(stream)` replays the whole graph after whatever `stream` holds.
    """

    def __init__(self, context: int) -> None:
        self._calls = graph_calls()
        self._context = context
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()

    def capture(self, stream: int, enqueue: Any) -> None:
        """Capture `enqueue()`'s work on `stream` and instantiate it. On any failure the stream leaves capture mode
        and nothing is kept (a `CudaError` or the enqueue's own exception propagates)."""
        calls = self._calls
        calls.begin(stream, _CAPTURE_THREAD_LOCAL)
        try:
            enqueue()
        finally:
            calls.end(stream, ctypes.byref(self._graph))  # ends capture mode even when the enqueue failed
        calls.instantiate(ctypes.byref(self._exec), self._graph, 0)

    def host_copies(self, host: int, size: int) -> list[HostCopy]:
        """The graph's copies to or from host memory in [host, host + size) (where the capture aimed them), each
        with the device address of its other side. A driver may keep a pinned address as host memory or as a
        unified address: the range says which side is the host's either way."""
        calls = self._calls
        count = ctypes.c_size_t()
        calls.nodes(self._graph, None, ctypes.byref(count))
        nodes = (ctypes.c_void_p * count.value)()
        calls.nodes(self._graph, nodes, ctypes.byref(count))
        copies = []
        for node in nodes:
            assert node is not None  # a c_void_p array item: None would be NULL, and the driver lists only real nodes
            kind = ctypes.c_int()
            calls.node_type(node, ctypes.byref(kind))
            if kind.value != _NODE_MEMCPY:
                continue
            params = Memcpy3D()
            calls.memcpy_params(node, ctypes.byref(params))
            src = ("srcHost", params.srcHost or 0) if params.srcMemoryType == _HOST else ("srcDevice", params.srcDevice)
            dst = ("dstHost", params.dstHost or 0) if params.dstMemoryType == _HOST else ("dstDevice", params.dstDevice)
            if host <= src[1] < host + size:
                copies.append(HostCopy(node, params, src[0], dst[1]))
            elif host <= dst[1] < host + size:
                copies.append(HostCopy(node, params, dst[0], src[1]))
        return copies

    def aim(self, copy: HostCopy, host: int) -> None:
        """Point `copy`'s host side at `host` for the launches from now on (launches already made keep theirs)."""
        setattr(copy.params, copy.host_field, host)
        self._calls.set_memcpy(self._exec, copy.node, copy.params_ref, self._context)

    def launch(self, stream: int) -> None:
        self._calls.launch(self._exec, stream)

    def __del__(self) -> None:
        # An executable graph destroyed while a launch is in flight is freed when that launch completes (CUDA's
        # contract); the memory its nodes use is the owner's to keep alive until then.
        try:
            if self._exec:
                self._calls.destroy_exec(self._exec)
            if self._graph:
                self._calls.destroy_graph(self._graph)
        except Exception:  # interpreter exit, or a context already gone
            pass
