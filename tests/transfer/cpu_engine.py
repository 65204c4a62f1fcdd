"""The GPU transfer engine on CPU memory: a driver whose copies are `memmove`s executed at once, staging and the
metadata ring in CPU tensors, and kernel launches mapped back to tensors and run in Triton's interpreter.

Used by `test_engine_on_cpu.py` (correctness of the engine's own logic in CI, which has no GPU); `copies=False`
leaves out the copies themselves (to time the enqueue's Python cost).
Enqueue order is a valid order for every stream dependency the engine records, so running each call at once is
faithful; both lanes share one staging buffer and ring, which is safe because nothing is ever in flight.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from collections import deque
from typing import Any

import torch

from kvferry.kernels import triton_copy
from kvferry.memory import HostPool
from kvferry.transfer import gpu_engine
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.lane import Lane
from tests.conftest import poisoned

STREAMS = (1, 2)  # a lane's slot streams, as the fake driver sees them (the caller's stream is 0)
# Events as the fake driver sees them: a lane's start, metadata-ready and per-slot joined events, and done-events.
START, META_READY, JOINED, DONE = 30, 40, 50, 1000
_done_events = itertools.count(DONE)


class CopyingDriver:
    """Driver calls on CPU memory: copies happen now; events are always complete; waits and records do nothing."""

    def __init__(self, copies: bool = True) -> None:
        self.copies = copies  # False: copies are skipped (to time the Python around them)
        self.log: list[tuple[str, int, int]] = []  # (call, stream, event or bytes): the order streams see
        self.copied: list[tuple[int, int, int]] = []  # (stream, destination, source) of every copy, in order
        self.requests_finish = True  # False: a request's done-event never reports finished

    def dtoh(self, host: int, dev: int, n: int, stream: int) -> None:
        self.log.append(("dtoh", stream, n))
        self.copied.append((stream, host, dev))
        if self.copies:
            ctypes.memmove(host, dev, n)

    def htod(self, dev: int, host: int, n: int, stream: int) -> None:
        self.log.append(("htod", stream, n))
        self.copied.append((stream, dev, host))
        if self.copies:
            ctypes.memmove(dev, host, n)

    has_batch = True

    def copy_batch(self, dsts: Any, srcs: Any, sizes: Any, stream: int) -> None:
        self.log.append(("batch", stream, len(sizes)))
        for dst, src, n in zip(dsts, srcs, sizes, strict=True):
            self.copied.append((stream, dst, src))
            if self.copies:
                ctypes.memmove(dst, src, n)

    def record(self, event: int, stream: int) -> None:
        self.log.append(("record", stream, event))

    def wait(self, stream: int, event: int, flags: int) -> None:
        self.log.append(("wait", stream, event))

    def query(self, event: int) -> bool:
        if event >= DONE:
            return self.requests_finish
        return True

    def synchronize(self, event: int) -> None:
        pass

    def current(self, context: int) -> Any:
        return _NoContext()


class _NoContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class World:
    """CPU stand-ins for device memory, and a launch_raw that maps raw addresses back to tensors."""

    def __init__(self, pool: HostPool, slot_bytes: int, slots: int = 2) -> None:
        self.staging = poisoned((slots * slot_bytes,), torch.uint8)
        self.meta = torch.zeros((Lane.META_SLOTS, Lane.META_INTS), dtype=torch.int64)
        self.meta_host = torch.zeros_like(self.meta)  # the pinned ring: zero-copy kernels read it in place
        self.pool = pool
        self.launches = 0

    def tensor_at(self, ptr: int) -> torch.Tensor:
        """A uint8 view starting at `ptr`, in staging or in the pool's slab."""
        for base in (self.staging, self.pool.slab):
            offset = ptr - base.data_ptr()
            if 0 <= offset < base.numel():
                return base[offset:]
        raise AssertionError(f"kernel launched on an address outside staging and the pool: {ptr:#x}")

    def ints_at(self, ptr: int) -> torch.Tensor:
        for ring in (self.meta, self.meta_host):
            flat = ring.view(-1)
            offset = ptr - flat.data_ptr()
            if 0 <= offset < flat.numel() * 8:
                assert offset % 8 == 0, "a misaligned table"
                return flat[offset // 8 :]
        raise AssertionError(f"a table outside the metadata rings: {ptr:#x}")

    def launch_raw(self, plan, stream, obj_ptr, off_ptr, cap_ptr, ids_ptr, to_objects, chunk, row0, n_rows,
                   rows=None, obj_shift=0, programs=None) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
        self.launches += 1
        table = [self.ints_at(off_ptr), self.ints_at(cap_ptr)]
        triton_copy.launch(plan, self.tensor_at(obj_ptr), table, self.ints_at(ids_ptr), to_objects, chunk, row0,
                           n_rows, rows, obj_shift)  # fmt: skip


def _lane(drv: CopyingDriver, world: World, slot_bytes: int, slots: int) -> Lane:
    lane = Lane.__new__(Lane)
    lane.__dict__.update(
        _driver=drv, streams=[], handles=list(STREAMS[:slots]), slot_bytes=slot_bytes, staging=world.staging,
        staging_ptr=world.staging.data_ptr(), start=START, meta_ready=META_READY,
        joined=[JOINED + s for s in range(slots)], next_slot=0, meta_host=world.meta_host, meta_dev=world.meta,
        meta_host_ptr=world.meta_host.data_ptr(), meta_dev_ptr=world.meta.data_ptr(),
        next_meta=0, lock=threading.Lock(), inflight=deque(), meta_owner=[None] * world.meta.shape[0],
    )  # fmt: skip
    lane.meta_host_flat = lane.meta_host.numpy().reshape(-1)
    lane.meta_host_bytes = memoryview(lane.meta_host_flat).cast("B")
    lane.ref = weakref.ref(lane)
    return lane


def completion_init(self: Any, drv: Any, context: int, lane: Any = None) -> None:
    self._driver, self.context, self._pool, self.event = drv, context, [], next(_done_events)
    self.lane, self.meta, self.fired = lane, -1, False


def engine_on(world: World, driver: CopyingDriver, config: EngineConfig) -> gpu_engine.TransferEngine:
    """A TransferEngine over `world`'s memory. The caller patches `torch._C._cuda_getCurrentRawStream`,
    `triton_copy.launch_raw` (to `world.launch_raw`) and `Completion.__init__`/`__del__` (see `completion_init`)."""
    slot_bytes = world.staging.numel() // 2
    engine = gpu_engine.TransferEngine.__new__(gpu_engine.TransferEngine)
    engine.__dict__.update(
        device=torch.device("cuda", 0), config=config, _driver=driver, _store=_lane(driver, world, slot_bytes, 2),
        _retrieve=_lane(driver, world, slot_bytes, 2), _context=0, _schedules={}, _batch=config.batch_dma,
        _graphs_failed=True,  # this driver captures no CUDA graphs: one-object requests take the staged path
    )  # fmt: skip
    return engine
