"""The disk tier's index: which object files exist, their sizes, and their order of last access.

Eviction is LRU by access: a put or a hit makes an object the most recent. The order survives a restart
because the tier touches a file's mtime on every hit and `scan` rebuilds the order from mtimes. Writes reserve
their bytes before they start, so concurrent writers never overshoot the capacity. Several processes may share
one directory; each keeps its own index (and so its own accounting) and adopts files the others wrote when
it meets them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from kvferry.tiers.base import TierFull
from kvferry.tiers.direct_io import unlink_quietly

OBJECT_SUFFIX = ".kvf"
TEMP_SUFFIX = ".tmp"
# A temp file older than this belongs to a writer that died; live writes take well under a second.
STALE_TEMP_S = 600.0


class DiskIndex:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._writing: set[str] = set()
        self._stored_bytes = 0
        self._reserved_bytes = 0

    @property
    def used_bytes(self) -> int:
        """Bytes on disk plus bytes of writes in progress."""
        with self._lock:
            return self._stored_bytes + self._reserved_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._sizes

    def scan(self, root: str) -> list[tuple[str, int]]:
        """Rebuild from the files under `root` (oldest access first) and delete stale temp files. Returns the
        (name, size) pairs evicted because the directory holds more than the capacity."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        for sub in os.scandir(root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                stat = entry.stat(follow_symlinks=False)
                if entry.name.endswith(OBJECT_SUFFIX):
                    found.append((stat.st_mtime_ns, f"{sub.name}/{entry.name}", stat.st_size))
                elif entry.name.endswith(TEMP_SUFFIX) and now - stat.st_mtime > STALE_TEMP_S:
                    unlink_quietly(entry.path)
        found.sort()
        with self._lock:
            self._sizes = OrderedDict((name, size) for _, name, size in found)
            self._stored_bytes = sum(self._sizes.values())
            return self._evict_locked(self._stored_bytes - self.capacity_bytes)

    def names(self) -> list[str]:
        """The objects stored now, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def touch(self, name: str, size: int) -> None:
        """Record an access (adopting a file another process wrote)."""
        with self._lock:
            if name in self._writing:  # our own write in progress: end_write records it
                return
            self._stored_bytes += size - self._sizes.pop(name, 0)
            self._sizes[name] = size

    def remove(self, name: str) -> None:
        with self._lock:
            size = self._sizes.pop(name, None)
            if size is not None:
                self._stored_bytes -= size

    def begin_write(self, name: str, nbytes: int) -> list[tuple[str, int]] | None:
        """Reserve room for a new object. Returns the (name, size) pairs evicted to make room (the caller
        deletes the files), or None when `name` is stored or being written already. TierFull if it cannot
        fit."""
        if nbytes > self.capacity_bytes:
            raise TierFull(f"object of {nbytes} bytes exceeds the capacity of {self.capacity_bytes} bytes")
        with self._lock:
            if name in self._sizes or name in self._writing:
                return None
            if self._reserved_bytes + nbytes > self.capacity_bytes:
                raise TierFull(f"{self._reserved_bytes} bytes of writes in flight leave no room for {nbytes}")
            evicted = self._evict_locked(self._stored_bytes + self._reserved_bytes + nbytes - self.capacity_bytes)
            self._writing.add(name)
            self._reserved_bytes += nbytes
            return evicted

    def end_write(self, name: str, nbytes: int, *, stored: bool) -> None:
        with self._lock:
            self._writing.discard(name)
            self._reserved_bytes -= nbytes
            if stored:  # a reader may have adopted the renamed file already (touch): count it once
                self._stored_bytes += nbytes - self._sizes.pop(name, 0)
                self._sizes[name] = nbytes

    def evict(self, nbytes: int) -> list[tuple[str, int]]:
        """Drop least recently used objects totalling at least `nbytes`; returns (name, size) pairs."""
        with self._lock:
            return self._evict_locked(nbytes)

    def _evict_locked(self, nbytes: int) -> list[tuple[str, int]]:
        evicted: list[tuple[str, int]] = []
        while nbytes > 0 and self._sizes:
            name, size = self._sizes.popitem(last=False)
            self._stored_bytes -= size
            nbytes -= size
            evicted.append((name, size))
        return evicted
