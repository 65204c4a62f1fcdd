"""A server's shared host pool (``cache.shared_pool``) mapped into this process, so that an engine copies located
objects (LOCATE) into its KV itself: the server's memfd opened through ``/proc/<pid>/fd/<fd>`` (the server's
process, this user's), mapped MAP_SHARED and, for a GPU engine, registered with CUDA as pinned memory.

The mapping keeps the pages alive: a server that exits or restarts leaves this process's view of the old pool as it
was (no other process can reuse those pages), so only a lease's deadline bounds what a copy may trust.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import torch

from kvferry.cuda.pinned import register_host_memory, register_pinned
from kvferry.protocol.shared_memory import is_shared_memory


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

    def views(
        self, objects: Sequence[tuple[int, int]], shape_of: Sequence[int], dtype: torch.dtype, token_axis: int
    ) -> list[torch.Tensor]:
        """The objects at ``(offset, tokens)`` as ``dtype`` tensors of shape ``shape_of`` with ``tokens`` on
        ``token_axis``; ValueError for one outside the pool."""
        views = []
        itemsize = dtype.itemsize
        for offset, tokens in objects:
            shape = list(shape_of)
            shape[token_axis] = tokens
            nbytes = torch.Size(shape).numel() * itemsize
            if offset < 0 or offset + nbytes > self.slab.numel() or offset % itemsize:
                raise ValueError(f"an object of {nbytes:,} bytes at {offset:,} is not inside the server's pool")
            views.append(self.slab[offset : offset + nbytes].view(dtype).view(shape))
        return views
