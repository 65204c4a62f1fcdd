"""A GPU engine's lane: one direction's streams, staging ring and request-metadata ring, allocated once.

A store and a retrieve each have their own lane, so one of each can be in flight at once. Every request takes a
metadata slot (block ids and object tables, pinned; copied to a device slot unless its kernels read the pinned one);
a slot is free once the request's done-event has fired, which the lane learns from the request's `Completion` or by
a query when it retires finished requests.
"""

from __future__ import annotations

import functools
import struct
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.cuda.driver import Driver
from kvferry.transfer.handle import Completion
from kvferry.transfer.schedule import Step


class Lane:
    """One direction's streams, staging ring and request-metadata ring (all allocated once)."""

    # Block ids + object tables of one request per slot (16K ints: a 250K-token request at 16-token blocks). A slot
    # is free once its request's kernels have run, and they queue behind the caller's stream: the ring holds that
    # many requests waiting on a busy model. Beyond it (or a larger request) a one-off buffer is allocated, and
    # allocating pinned or device memory synchronises the device, so the ring is generous.
    META_SLOTS = 32
    META_INTS = 1 << 14

    def __init__(self, drv: Driver, device: torch.device, slots: int, slot_bytes: int, priority: int) -> None:
        self._driver = drv
        # One stream per staging slot runs that slot's gathers (scatters) and DMAs in order: stream order is what
        # frees a slot for its next slice, so slices need no events. (High priority: see EngineConfig.)
        self.streams = [torch.cuda.Stream(device, priority=priority) for _ in range(slots)]
        self.handles = [stream.cuda_stream for stream in self.streams]
        self.slot_bytes = slot_bytes
        self.staging = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
        self.staging_ptr = self.staging.data_ptr()
        self.start = drv.event()  # the caller's stream, as of the request being enqueued
        self.meta_ready = drv.event()  # a request's metadata upload, for its streams other than the first
        self.joined = [drv.event() for _ in range(slots)]  # a slot stream's part of a request, for the last stream
        self.next_slot = 0
        self.meta_host = torch.empty((self.META_SLOTS, self.META_INTS), dtype=torch.int64, pin_memory=True)
        self.meta_host_flat = self.meta_host.numpy().reshape(-1)
        self.meta_host_bytes = self.meta_host_flat.data.cast("B")
        self.meta_dev = torch.empty((self.META_SLOTS, self.META_INTS), dtype=torch.int64, device=device)
        self.meta_host_ptr, self.meta_dev_ptr = self.meta_host.data_ptr(), self.meta_dev.data_ptr()
        self.next_meta = 0
        # The request that used each metadata slot last, until it is seen finished (then None): the slot is free
        # once its done-event has fired (recorded after every kernel and DMA of it), and a slot whose owner is None
        # needs no event query, a driver call (~5 us on a slow host) on the path to the first GPU operation.
        # (Holding the owner keeps its pooled event from being recorded for another request meanwhile.)
        self.meta_owner: list[Completion | None] = [None] * self.META_SLOTS
        self.lock = threading.Lock()
        self.inflight: deque[tuple[Completion, object]] = deque()  # what a request's GPU work still reads
        self.ref = weakref.ref(self)  # how a request's completion reaches its lane (weakly: no cycle)

    def upload(
        self, parts: list[np.ndarray | list[int] | bytes], n: int, done: Completion, stream: int, to_device: bool = True
    ) -> tuple[int, object]:
        """Write request metadata (`n` int64s: arrays, lists or their bytes) into a pinned slot; return the address
        the kernels read it at, and a keepalive.

        `to_device`: copied to a device slot on `stream` (a device slot is reused only once the host slot is).
        Otherwise the kernels read the pinned slot itself: a zero-copy request's kernel reads host memory anyway,
        and this takes a driver call and a small DMA off the path to its launch. A host slot whose last request
        has not run yet (requests queued behind a busy compute stream) is skipped for a one-off pinned buffer rather
        than waited for. (The slot is free once its owner's done-event fired: later than needed for an upload,
        exactly when needed for kernels that read the slot.) Lists are packed with `struct`, arrays copied by
        numpy.
        """
        k = self.next_meta
        owner = self.meta_owner[k]
        if n <= self.META_INTS and (owner is None or self._driver.query(owner.event)):
            self.next_meta = (k + 1) % self.META_SLOTS
            self.meta_owner[k] = done
            done.meta = k
            offset = k * self.META_INTS * 8
            at, slab = offset, self.meta_host_bytes
            for p in parts:
                if type(p) is bytes:
                    slab[at : at + len(p)] = p
                    at += len(p)
                elif type(p) is list:
                    _int64s(len(p)).pack_into(slab, at, *p)
                    at += 8 * len(p)
                else:
                    self.meta_host_flat[at // 8 : at // 8 + len(p)] = p
                    at += 8 * len(p)
            if not to_device:
                return self.meta_host_ptr + offset, None
            dev = self.meta_dev_ptr + offset
            self._driver.htod(dev, self.meta_host_ptr + offset, n * 8, stream)
            return dev, None
        flat = [np.frombuffer(p, dtype=np.int64) if type(p) is bytes else np.asarray(p, dtype=np.int64) for p in parts]
        host = torch.from_numpy(np.concatenate(flat)).pin_memory()
        if not to_device:
            return host.data_ptr(), host
        buf = torch.empty(n, dtype=torch.int64, device=self.staging.device)
        for s in self.streams:  # allocated on the caller's stream, read on the lane's
            buf.record_stream(s)
        self._driver.htod(buf.data_ptr(), host.data_ptr(), n * 8, stream)
        return buf.data_ptr(), (host, buf)

    def retire(self) -> None:
        """Drop the keepalives of finished requests (oldest first; one seen fired takes no query). Call with the
        lock held."""
        inflight, query = self.inflight, self._driver.query
        while inflight and (inflight[0][0].fired or query(inflight[0][0].event)):
            self._release(inflight.popleft()[0])

    def finished(self, done: Completion) -> None:
        """`done` has fired: the metadata slot it used is idle."""
        with self.lock:
            self._release(done)

    def _release(self, done: Completion) -> None:
        if done.meta >= 0 and self.meta_owner[done.meta] is done:
            self.meta_owner[done.meta] = None

    def __del__(self) -> None:
        try:
            if self.inflight:  # requests may still read staging or metadata: drain before the memory goes back
                for stream in self.streams:
                    stream.synchronize()
            for e in (self.start, self.meta_ready, *self.joined):
                self._driver.destroy(e)
        except Exception:  # a CudaError, __init__ failed half way, or interpreter exit (module globals gone)
            pass


@dataclass(slots=True)
class LeadDMA:
    """A retrieve's first DMA into staging, started before the rest of the request is known
    (`TransferEngine.lead`): it holds its lane until the request's `submit` takes it over, or until `release`, so
    that no other request uses its slot meanwhile. It touches no KV and waits for nothing."""

    lane: Lane
    slot: int
    host: int  # the host address it copies from
    nbytes: int
    held: bool = True

    def covered(self, step: Step, ptrs: list[int]) -> int:
        """How many of `step`'s leading parts this DMA copied, where `step` is a request's first slice (its objects
        at `ptrs`): those whose host bytes and staging address it spanned, in the same slot, ending where one ends;
        0 where it is not such a run. Its slot's stream runs it before anything of the request; the slice's other
        parts follow it there. (A lead DMA of other bytes only wrote staging, which the first slice's own DMAs,
        after it on that stream, overwrite.)"""
        if step.slot != self.slot:
            return 0
        start, copied = self.lane.staging_ptr + self.slot * self.lane.slot_bytes, 0
        for k, (o, offset, n, dev) in enumerate(step.parts):
            if ptrs[o] + offset != self.host + copied or dev != start + copied:
                return 0
            copied += n
            if copied >= self.nbytes:
                return k + 1 if copied == self.nbytes else 0
        return 0

    def release(self) -> None:
        """Give the lane back (again: nothing); a submit that took the lead over releases it itself."""
        if self.held:
            self.held = False
            self.lane.lock.release()


@functools.lru_cache(maxsize=64)
def _int64s(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")
