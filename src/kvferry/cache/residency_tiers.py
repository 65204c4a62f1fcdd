"""The host pool's side of its storage tiers: tier writes that finish, and objects promoted from a tier.

A base of ``Residency``, over its room in the pool (`kvferry.cache.eviction`): kept apart so each file reads as
one job.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from kvferry.cache.eviction import PoolEviction
from kvferry.cache.index import Entry, State


class TierTraffic(PoolEviction):
    """Methods of ``Residency`` for tier I/O; each takes the lock itself."""

    def tier_write_done(self, entry: Entry, ok: bool, spilled: bool) -> None:
        """A tier write of ``entry`` finished; a spilled (evicted) entry is freed unless it was used meanwhile."""
        with self.lock:
            entry.readers -= 1
            if ok:
                entry.persisted = True
                self.counters.tier_writes += 1
            else:
                self.counters.tier_write_failures += 1
            if spilled:  # wake stores waiting for room (they re-check under the lock once we release it)
                self._spills_finished += 1
                self._spill_finished.notify_all()
            if entry.detached:
                if entry.readers == 0:
                    self._free_locked(entry)
                return
            if not spilled:
                return
            self._spilling_bytes -= entry.nbytes
            if entry.readers == 0 and entry.pins == 0:
                self._drop_evicted_locked(entry)
            else:  # locked or read while it was being written: keep it, it is wanted
                entry.state = State.RESIDENT
                self.policy.insert(entry.key)

    def begin_promotion(self, key: bytes, parent: bytes | None) -> Entry | None:
        """Index a LOADING entry for ``key`` (whose previous chunk is ``parent``); None if the key is already
        indexed (someone else has it)."""
        with self.lock:
            if key in self.index:
                return None
            entry = Entry(key, State.LOADING, loaded=Future(), parent=parent)
            self.index.add(entry)
            return entry

    def alloc_for_promotion(self, entry: Entry, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        with self.lock:
            if entry.detached or entry.obj is not None or nbytes > self.pool.capacity_bytes:
                return None
            to_spill = self._make_room_locked(nbytes)
            obj = self._alloc_locked(tuple(shape), dtype, nbytes, to_spill)
            entry.obj, entry.nbytes = obj, nbytes if obj is not None else 0
        self._spill(to_spill)
        return obj

    def free_promotion_buffer(self, entry: Entry, obj: torch.Tensor) -> None:
        with self.lock:
            if entry.obj is obj:
                entry.obj, entry.nbytes = None, 0
            self.pool.free(obj)

    def end_promotion(self, entry: Entry, obj: torch.Tensor | None, checksum: bytes | None) -> None:
        self._end_promotion(entry, obj, checksum)
        assert entry.loaded is not None
        entry.loaded.set_result(None)  # outside the lock: waiters' callbacks may call back in

    def _end_promotion(self, entry: Entry, obj: torch.Tensor | None, checksum: bytes | None) -> None:
        with self.lock:
            if obj is None or obj is not entry.obj:
                self.counters.promotion_misses += 1
                if entry.obj is not None:
                    self.pool.free(entry.obj)
                    entry.obj = None
                if not entry.detached:
                    self.index.pop(entry.key)
                return
            self.counters.promotions += 1
            entry.state, entry.checksum, entry.persisted = State.RESIDENT, checksum, True
            if entry.detached:
                self._free_locked(entry)
            else:
                self.policy.insert(entry.key)
                if self.events is not None:
                    self.events.promoted(entry)
