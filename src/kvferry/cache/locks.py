"""Lookup locks: pins on a prefix's objects that keep eviction away until a retrieve or a timeout ends them."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvferry.cache.index import Entry


@dataclass(slots=True)
class _Lease:
    entries: tuple[Entry, ...]
    deadline: float


class LeaseTable:
    """Active lookup locks by id. A lock pins each of its entries once; ending it (release or expiry) unpins.

    Holding entries rather than keys means a lock can never unpin a newer object stored under the same key.
    Not thread-safe: the cache engine calls it under its lock.
    """

    def __init__(self) -> None:
        self._leases: dict[int, _Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # min-heap; stale ids are skipped when popped
        self._next_id = 1

    def acquire(self, entries: tuple[Entry, ...], deadline: float) -> int:
        """Pin ``entries`` until ``deadline`` (time.monotonic seconds); returns the lock id."""
        lock_id = self._next_id
        self._next_id += 1
        for entry in entries:
            entry.pins += 1
        self._leases[lock_id] = _Lease(entries, deadline)
        heapq.heappush(self._deadlines, (deadline, lock_id))
        return lock_id

    def release(self, lock_id: int) -> bool:
        """End lock ``lock_id``; False if it is unknown (already released or expired)."""
        lease = self._leases.pop(lock_id, None)
        if lease is None:
            return False
        for entry in lease.entries:
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
        for lock_id in list(self._leases):
            self.release(lock_id)
        self._deadlines.clear()

    @property
    def pinned_objects(self) -> int:
        return len({id(e) for lease in self._leases.values() for e in lease.entries})

    def __len__(self) -> int:
        return len(self._leases)
