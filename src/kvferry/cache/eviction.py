"""Room in the host pool: eviction down to the watermark in the policy's batches, evicted objects spilled to the
first tier (write-behind) or dropped, allocation that evicts batches while the pool has no room for it, and an
object's memory freed exactly once. A batch is ``cache.eviction_batch`` objects, but at most a quarter of the pool's.

The base of ``Residency`` (which adds lookup locks, readers and writers): its state, under its one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvferry.cache.event_hooks import CacheEvents
from kvferry.cache.index import CacheIndex, Entry, State
from kvferry.cache.metrics import CacheCounters
from kvferry.cache.policies import EvictionPolicy
from kvferry.config import CacheConfig
from kvferry.memory import HostPool


class PoolEviction:
    """The pool, its index and eviction policy under ``lock``. Public methods take ``lock`` themselves; methods
    whose name ends in ``_locked`` are called with it held."""

    def __init__(self, pool: HostPool, policy: EvictionPolicy, config: CacheConfig, counters: CacheCounters) -> None:
        self.lock = threading.Lock()
        self.pool = pool
        self.policy = policy
        self.index = CacheIndex()
        self.counters = counters
        self._config = config
        # Set when evicted objects go to the first tier (write-behind) rather than being dropped: submits the
        # tier writes of entries chosen for eviction; called without the lock.
        self.on_spill: Callable[[list[Entry]], None] | None = None
        self._spilling_bytes = 0  # pool bytes of SPILLING entries: freed once their tier writes finish
        self._spills_finished = 0  # count of finished spills; a store waiting for room watches it change
        self._spill_finished = threading.Condition(self.lock)
        self.events: CacheEvents | None = None  # KV events' hooks, when the cache publishes them

    if TYPE_CHECKING:  # Residency's: lookup locks that expired release their entries for eviction

        def expire_locks_locked(self) -> None: ...

    def demote(self, keys: list[bytes]) -> None:
        """Move these to the front of the eviction order (superseded tails, chunks only a shorter prefix needs)."""
        with self.lock:
            for key in keys:
                self.policy.demote(key)

    def settle(self) -> None:
        """Evict down to the watermark (after ``Residency.reserve``; see there)."""
        with self.lock:
            to_spill = self._make_room_locked(0)
        self._spill(to_spill)

    def make_room(self, nbytes: int) -> None:
        """Evict batches until ``nbytes`` fit in the pool's free room, not just under the watermark: what a store
        about to copy ahead of its keys needs (`ChunkWriter._ahead`). Bytes being spilled count as free (they are
        on their way out); nothing is evicted for more than the pool holds."""
        if nbytes > self.pool.capacity_bytes:
            return
        with self.lock:
            self.expire_locks_locked()
            to_spill = self._evict_bytes_locked(nbytes - self.pool.free_bytes - self._spilling_bytes)
        self._spill(to_spill)

    def _make_room_locked(self, nbytes: int) -> list[Entry]:
        """Evict batches until ``nbytes`` more fit under the watermark (or nothing is evictable).

        Returns the entries that must be spilled to the first tier; the caller submits their writes after
        releasing the lock. Bytes already being spilled count as free: they are on their way out.
        """
        self.expire_locks_locked()
        limit = self._config.watermark * self.pool.capacity_bytes
        return self._evict_bytes_locked(self.pool.used_bytes - self._spilling_bytes + nbytes - limit)

    def _evict_bytes_locked(self, excess: float) -> list[Entry]:
        """Evict the policy's batches until ``excess`` bytes are out (or nothing is evictable); returns the entries
        to spill."""
        to_spill: list[Entry] = []
        while excess > 0:
            victims = self.policy.evict(self._batch_locked(), self._evictable)
            if not victims:
                break
            for key in victims:
                entry = self.index.get(key)
                assert entry is not None, "policy returned a key the index does not hold"
                excess -= entry.nbytes
                self._evict_locked(entry, to_spill)
        return to_spill

    def _alloc_locked(
        self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, to_spill: list[Entry]
    ) -> torch.Tensor | None:
        obj = self.pool.try_alloc(shape, dtype)
        while obj is None and nbytes <= self.pool.capacity_bytes:
            # Below the watermark but no room (fragmentation, or memory still held by spills): batches until it
            # fits, while they free memory (a batch that only starts spills frees none yet: one such is enough).
            free = self.pool.free_bytes
            victims = self.policy.evict(self._batch_locked(), self._evictable)
            for key in victims:
                entry = self.index.get(key)
                assert entry is not None
                self._evict_locked(entry, to_spill)
            obj = self.pool.try_alloc(shape, dtype)
            if not victims or self.pool.free_bytes == free:
                break
        return obj

    def _batch_locked(self) -> int:
        """Objects one eviction takes: ``cache.eviction_batch``, but no more than a quarter of those the pool holds.
        A batch amortises the policy's work over a large pool; in a pool of a few dozen objects a whole batch would
        empty it, down to the objects just stored."""
        return max(1, min(self._config.eviction_batch, len(self.index) // 4))

    def _evictable(self, key: bytes) -> bool:
        entry = self.index.get(key)
        return entry is not None and entry.evictable

    def _spill(self, entries: list[Entry]) -> None:
        if entries:
            assert self.on_spill is not None, "entries are only chosen for spilling when on_spill is set"
            self.on_spill(entries)

    def _evict_locked(self, entry: Entry, to_spill: list[Entry]) -> None:
        if self.on_spill is not None and not entry.persisted and not entry.tail:  # tails stay in the pool
            entry.state = State.SPILLING
            entry.readers += 1  # the tier write reads it
            self._spilling_bytes += entry.nbytes
            to_spill.append(entry)
            return
        self._drop_evicted_locked(entry)

    def _drop_evicted_locked(self, entry: Entry) -> None:
        """Take an evicted entry (dropped, or spilled and idle since) out of the index and free its memory."""
        self.index.pop(entry.key)
        self._free_locked(entry)
        self.counters.evictions += 1
        self.counters.evicted_bytes += entry.nbytes

    def _free_locked(self, entry: Entry) -> None:
        if entry.obj is not None:
            self.pool.free(entry.obj)
            entry.obj = None
