"""A server's shared host pool (``cache.shared_pool``) mapped into this process, so that an engine copies located
objects (LOCATE) into its KV itself: the server's memfd opened through ``/proc/<pid>/fd/<fd>`` (the server's
process, this user's), mapped MAP_SHARED and, for a GPU engine, registered with CUDA as pinned memory.

The mapping keeps the pages alive: a server that exits or restarts leaves this process's view of the old pool as it
was (no other process can reuse those pages), so only a lease's deadline bounds what a copy may trust.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence

import torch

from kvferry.cuda.pinned import register_host_memory, register_pinned
from kvferry.protocol.shared_memory import is_shared_memory

log = logging.getLogger(__name__)


class PoolMapping:
    """One server pool as this process maps it."""

    def __init__(self, pid: int, fd: int, nbytes: int, pin: bool) -> None:
        """``pin``: register the mapping with CUDA (~0.4 s a GiB on an H100 host, once), so DMAs read it directly.
        OSError where the pool cannot be opened (another user's server, another host's, a process gone) or is not
        shared memory of that size."""
        path = f"/proc/{pid}/fd/{fd}"
        if not is_shared_memory(os.readlink(path)):
            raise OSError(f"{path} is not a shared-memory file")
        opened = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(opened).st_size
            if size < nbytes:
                raise OSError(f"{path} holds {size:,} bytes, not the pool's {nbytes:,}")
            self._mapping = mmap.mmap(opened, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(opened)
        self.key = (pid, fd, nbytes)
        self.slab = torch.frombuffer(self._mapping, dtype=torch.uint8)
        if pin:
            start = self.slab.data_ptr()
            register_host_memory(self, start, nbytes)
            register_pinned(self, start, nbytes)

    def object_at(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The object of ``shape``/``dtype`` at byte ``offset``; ValueError for one outside the pool."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if offset < 0 or offset + nbytes > self.slab.numel() or offset % dtype.itemsize:
            raise ValueError(f"an object of {nbytes:,} bytes at {offset:,} is not inside the server's pool")
        return self.slab[offset : offset + nbytes].view(dtype).view(shape)


class MappedPool:
    """The server's pool as this process maps it for its direct loads and stores, mapped once (again where the
    server changed: a restart's new pool). Thread-safe."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._lock = threading.Lock()
        self._mapping: PoolMapping | None = None

    def get(self, pool: tuple[int, int, int]) -> PoolMapping:
        """The pool named (pid, descriptor, bytes) mapped here; OSError where it cannot be (see `PoolMapping`)."""
        with self._lock:
            if self._mapping is None or self._mapping.key != pool:
                started = time.monotonic()
                self._mapping = PoolMapping(*pool, pin=self._pin)
                log.info(
                    "kvferry: mapped the server's shared pool (%.1f GiB%s) in %.2f s",
                    pool[2] / 2**30,
                    ", pinned" if self._pin else "",
                    time.monotonic() - started,
                )
            return self._mapping
