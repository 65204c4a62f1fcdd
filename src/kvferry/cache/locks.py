"""Lookup locks: pins on a prefix's objects that keep eviction away until a retrieve or a timeout ends them; and
read leases, readers held on located objects (`CacheEngine.locate`) that keep their memory as it is until the
reader releases them or their deadline passes, whatever happens to the objects meanwhile."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.cache.index import Entry


@dataclass(slots=True)
class _Lease:
    entries: tuple[Entry, ...]
    deadline: float
    reading: bool  # readers held (a read lease), not pins


class LeaseTable:
    """Active lookup locks by id. A lock pins each of its entries once; ending it (release or expiry) unpins.

    Holding entries rather than keys means a lock can never unpin a newer object stored under the same key.
    Not thread-safe: the cache engine calls it under its lock.
    """

    def __init__(self, end_read: Callable[[Entry], None] | None = None) -> None:
        """``end_read``: ends the reader of each entry of a read lease that ends (the cache's also frees an object
        detached meanwhile); by default the reader count goes down."""
        self._end_read = end_read or _drop_reader
        self._leases: dict[int, _Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # min-heap; stale ids are skipped when popped
        self._next_id = 1

    def acquire(self, entries: tuple[Entry, ...], deadline: float, reading: bool = False) -> int:
        """Pin ``entries`` (``reading``: hold a reader on each) until ``deadline`` (time.monotonic seconds);
        returns the lock id."""
        lock_id = self._next_id
        self._next_id += 1
        for entry in entries:
            if reading:
                entry.readers += 1
            else:
                entry.pins += 1
        self._leases[lock_id] = _Lease(entries, deadline, reading)
        heapq.heappush(self._deadlines, (deadline, lock_id))
        return lock_id

    def release(self, lock_id: int) -> bool:
        """End lock ``lock_id``; False if it is unknown (already released or expired)."""
        lease = self._leases.pop(lock_id, None)
        if lease is None:
            return False
        for entry in lease.entries:
            if lease.reading:
                self._end_read(entry)
            else:
                entry.pins -= 1
        return True

    def expire(self, now: float) -> int:
        """End every lock whose deadline has passed; returns how many ended."""
        ended = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lock_id = heapq.heappop(self._deadlines)
            ended += self.release(lock_id)
        return ended

    def release_all(self) -> None:
        """End every lock; read leases stay (a process may be copying from their objects) until released or due."""
        for lock_id in [i for i, lease in self._leases.items() if not lease.reading]:
            self.release(lock_id)

    @property
    def pinned_objects(self) -> int:
        return len({id(e) for lease in self._leases.values() if not lease.reading for e in lease.entries})

    @property
    def read_leases(self) -> int:
        return sum(lease.reading for lease in self._leases.values())

    def __len__(self) -> int:
        """Lookup locks held (read leases not counted)."""
        return len(self._leases) - self.read_leases


def _drop_reader(entry: Entry) -> None:
    entry.readers -= 1
