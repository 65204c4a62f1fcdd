"""What is in the host pool: the index, the eviction policy, lookup locks and pool memory, under one lock.

This module: lookups and their locks, readers, and a store's objects from ``reserve`` to ``commit``. Its bases
hold the rest: room in the pool (eviction, spills, freeing) in `kvferry.cache.eviction`, tier writes and
promotions in `kvferry.cache.residency_tiers`.

Invariants (all under ``lock``):
- the policy tracks exactly the indexed entries in state RESIDENT;
- an entry with readers, pins, or a state other than RESIDENT is never evicted;
- pool memory is freed exactly once: by eviction of an idle entry, by a failed store or promotion, or by the
  last reader of an entry detached from the index (``clear``, a failed checksum) while in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch

from kvferry.cache.event_hooks import StoreTokens
from kvferry.cache.index import RESIDENT, SPILLING, WRITING, Entry, State
from kvferry.cache.locks import LeaseTable
from kvferry.cache.metrics import CacheCounters
from kvferry.cache.policies import EvictionPolicy
from kvferry.cache.residency_tiers import TierTraffic
from kvferry.config import CacheConfig
from kvferry.memory import HostPool


class Residency(TierTraffic):
    """The host pool's contents. Every public method takes ``lock`` itself unless its name ends in ``_locked``."""

    def __init__(self, pool: HostPool, policy: EvictionPolicy, config: CacheConfig, counters: CacheCounters) -> None:
        super().__init__(pool, policy, config, counters)
        self.leases = LeaseTable(self.release_reader_locked)
        # Stores waiting for another store's chunks in flight (await_written); commit and abort wake them.
        self._written = threading.Condition(self.lock)
        self._written_waiters = 0
        # Objects assembled from head slices still missing some, by key, oldest first (they expire in that order).
        self._partials: dict[bytes, Entry] = {}

    # --- lookups and locks --------------------------------------------------------------------------------

    def readable_prefix_locked(self, keys: Iterable[bytes]) -> list[Entry]:
        """The entries of the leading ``keys`` that are readable now, up to the first that is not."""
        hits = []
        get = self.index.get
        for key in keys:
            entry = get(key)
            if entry is None or (entry.state is not RESIDENT and entry.state is not SPILLING):
                break
            hits.append(entry)
        return hits

    def still_readable_locked(self, entries: list[Entry], removals: int = -1) -> list[Entry]:
        """The leading ``entries`` (found readable without the lock) that are still indexed and readable.

        ``removals``: ``index.removals`` read before the entries were looked up; if no entry has left the index
        since, all still are (see ``CacheIndex``), and the check of each one is skipped."""
        if removals == self.index.removals:
            return entries
        get = self.index.get
        for i, entry in enumerate(entries):
            state = entry.state
            if (state is not RESIDENT and state is not SPILLING) or get(entry.key) is not entry:
                return entries[:i]
        return entries

    def lock_entries_locked(self, entries: list[Entry]) -> int:
        return self.leases.acquire(tuple(entries), time.monotonic() + self._config.lock_timeout_s)

    def lease_readers_locked(self, entries: list[Entry]) -> tuple[int, float]:
        """A read lease on ``entries`` (readable ones): its id and deadline (time.monotonic seconds)."""
        deadline = time.monotonic() + self._config.lock_timeout_s
        for entry in entries:
            self.policy.touch(entry.key)
        return self.leases.acquire(tuple(entries), deadline, reading=True), deadline

    def release_lock(self, lock_id: int) -> bool:
        with self.lock:
            return self.leases.release(lock_id)

    def release_locks(self, lock_ids: Iterable[int]) -> int:
        with self.lock:
            return sum(map(self.leases.release, lock_ids))

    def expire_locks_locked(self) -> None:
        now = time.monotonic()
        self.counters.lock_timeouts += self.leases.expire(now)
        if self._partials:
            self._expire_partials_locked(now)

    def _expire_partials_locked(self, now: float) -> None:
        """Drop assembled objects whose other slices did not come in time (a rank that skipped or died)."""
        for entry in list(self._partials.values()):
            if entry.expires > now:
                break
            if entry.writers == 0:
                self.detach_locked(entry)
                self.counters.expired_partial_chunks += 1

    # --- reading ------------------------------------------------------------------------------------------

    def acquire_readers(self, entries: list[Entry], removals: int = -1) -> list[Entry]:
        """The leading ``entries`` still readable (see ``still_readable_locked``), each with a reader held (so
        eviction passes them over)."""
        with self.lock:
            hits = self.still_readable_locked(entries, removals)
            for entry in hits:
                entry.readers += 1
                self.policy.touch(entry.key)
            return hits

    def release_readers(self, entries: Iterable[Entry]) -> None:
        with self.lock:
            for entry in entries:
                self.release_reader_locked(entry)

    def release_reader_locked(self, entry: Entry) -> None:
        entry.readers -= 1
        if entry.detached and entry.readers == 0:
            self._free_locked(entry)

    def detach_locked(self, entry: Entry) -> None:
        """Drop ``entry`` from the index now; its memory goes back when nobody uses it any more."""
        if self.index.get(entry.key) is entry:
            self.index.pop(entry.key)
            self.policy.remove(entry.key)
        if entry.state is State.SPILLING:
            self._spilling_bytes -= entry.nbytes
        self._forget_partial_locked(entry)
        entry.detached = True
        # An object being written is freed by its last writer (an assembled one waiting for slices has none).
        if entry.readers == 0 and entry.writers == 0 and entry.state is not State.LOADING:
            self._free_locked(entry)

    # --- writing ------------------------------------------------------------------------------------------

    def reserve(
        self,
        keys: list[bytes],
        parent: bytes | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        nbytes: int,
        heads: tuple[int, int] | None = None,
        tail: int = 0,
    ) -> tuple[list[tuple[int, Entry]], list[tuple[int, Entry]]]:
        """Index a WRITING entry with pool memory for every key not yet present, in order; returns them with
        their positions in ``keys``, and the entries found WRITING for another store (with their positions: the
        caller waits for them, see ``await_written``). ``keys`` are consecutive chunks; ``parent`` is the key of
        the chunk before ``keys[0]`` (None when it is chunk 0): entries record their parent for lookups to walk.
        ``tail``: ``keys`` is one tail object of that many tokens after chunk ``parent`` (see `kvferry.cache.tails`).

        ``heads`` = (this store's heads, every head), bit masks: the store writes a slice of each object (a
        tensor-parallel rank). An object being assembled that still misses exactly these heads is returned with
        the new ones, for this store to write its slice into; one whose heads are taken counts as present. A new
        object waits ``slice_wait_s`` for its other slices, readable only once every head is written.

        Objects come from the pool's free room first, even above the watermark: ``settle`` evicts back under
        it, which the caller runs while the new objects are being written (eviction is then off a store's path
        to its copy). Only a pool with no room for them evicts here. When the pool is full and evicted objects
        are still being written to a tier, waits up to ``spill_wait_s`` for their memory. Once an allocation
        fails for good (the pool is full of locked or in-use objects), every later new chunk is skipped: with
        prefix lookups a chunk after a hole could never be hit. Present and skipped chunks are counted.
        """
        new: list[tuple[int, Entry]] = []
        others: list[tuple[int, Entry]] = []
        deadline: float | None = None  # set once a store first finds no room: the common case never reads a clock
        start = 0  # keys[:start] are placed or present
        get, add, touch = self.index.get, self.index.add, self.policy.touch
        if nbytes > self.pool.capacity_bytes:  # could never fit: evicting for it would only empty the pool
            with self.lock:
                missing = sum(1 for key in keys if get(key) is None)
                self.counters.skipped_chunks += missing
                self.counters.present_chunks += len(keys) - missing
            return new, others
        while True:
            with self.lock:
                self.expire_locks_locked()
                missing = sum(1 for i in range(start, len(keys)) if get(keys[i]) is None)
                # All at once while they fit (one pool call); one by one, evicting more, after that.
                fresh = iter(self.pool.try_alloc_many(shape, dtype, missing)) if missing else iter(())
                to_spill: list[Entry] = []
                blocked = False
                for i in range(start, len(keys)):
                    key = keys[i]
                    present = get(key)
                    if present is not None:
                        touch(key)
                        if present.state is WRITING:
                            if heads is None or not present.unclaimed_heads:
                                others.append((i, present))
                            elif present.unclaimed_heads & heads[0] == heads[0]:  # the slice it waits for: join
                                present.unclaimed_heads &= ~heads[0]
                                present.writers += 1
                                new.append((i, present))
                    else:
                        obj = next(fresh, None)
                        if obj is None:
                            obj = self._alloc_locked(shape, dtype, nbytes, to_spill)
                        if obj is None:
                            blocked = True
                            break
                        entry = Entry(
                            key, WRITING, obj, nbytes, parent=keys[i - 1] if i else parent, writers=1, tail=tail
                        )
                        if heads is not None:
                            entry.unclaimed_heads = heads[1] & ~heads[0]
                            entry.expires = time.monotonic() + self._config.slice_wait_s
                            self._partials[key] = entry
                        add(entry)
                        new.append((i, entry))
                    start = i + 1
                wait = False
                if blocked and self._spilling_bytes > 0:
                    now = time.monotonic()
                    deadline = now + self._config.spill_wait_s if deadline is None else deadline
                    wait = now < deadline
                generation = self._spills_finished
                if not wait:
                    skipped = sum(1 for i in range(start, len(keys)) if get(keys[i]) is None) if blocked else 0
                    self.counters.skipped_chunks += skipped
                    self.counters.present_chunks += len(keys) - len(new) - skipped
            self._spill(to_spill)
            if not wait:
                return new, others
            assert deadline is not None
            with self._spill_finished:
                while self._spills_finished == generation and (left := deadline - time.monotonic()) > 0:
                    self._spill_finished.wait(left)

    def index_written(
        self, keys: list[bytes], parent: bytes | None, objects: list[torch.Tensor], nbytes: int, tail: int = 0
    ) -> tuple[list[tuple[int, Entry]], list[torch.Tensor], list[tuple[int, Entry]]]:
        """``reserve`` for objects the caller allocated from the pool and is copying or has copied into (one per
        key): a WRITING entry with its object for every key not yet present. Returns the entries with their
        positions, the objects of the keys found present, which the caller frees once its copy has finished, and
        the entries found WRITING for another store (as ``reserve``). ``tail``: as ``reserve``'s."""
        new: list[tuple[int, Entry]] = []
        spare: list[torch.Tensor] = []
        others: list[tuple[int, Entry]] = []
        with self.lock:
            self.expire_locks_locked()
            get, add, touch = self.index.get, self.index.add, self.policy.touch
            for i, key in enumerate(keys):
                present = get(key)
                if present is not None:
                    touch(key)
                    spare.append(objects[i])
                    if present.state is WRITING:
                        others.append((i, present))
                else:
                    before = keys[i - 1] if i else parent
                    entry = Entry(key, WRITING, objects[i], nbytes, parent=before, writers=1, tail=tail)
                    add(entry)
                    new.append((i, entry))
            self.counters.present_chunks += len(spare)
        return new, spare, others

    def await_written(self, others: list[tuple[int, Entry]], deadline: float) -> list[int]:
        """Wait (until ``deadline``, time.monotonic) for other stores' entries found WRITING to be committed or
        aborted; returns the positions of those that are no longer cached (their store failed, or they left the
        pool meanwhile): the caller stores them itself. Entries still being written at the deadline are left to
        their store."""
        with self._written:
            self._written_waiters += 1
            try:
                while True:
                    writing = False
                    lost = []
                    for i, entry in others:
                        if entry.detached or self.index.get(entry.key) is not entry:
                            lost.append(i)
                        elif entry.state is WRITING:
                            writing = True
                    left = deadline - time.monotonic()
                    if not writing or left <= 0:
                        return lost
                    self._written.wait(left)
            finally:
                self._written_waiters -= 1

    def end_writes(self, entries: list[Entry]) -> list[Entry]:
        """A store's copy into ``entries`` has finished: those now whole (no other store writing into them, no
        head slice missing) are returned, still WRITING, for the caller to checksum and ``commit``."""
        whole = []
        with self.lock:
            for entry in entries:
                if entry.writers == 1 and not entry.unclaimed_heads and not entry.detached:
                    whole.append(entry)  # its writer holds it until commit
                    continue
                entry.writers -= 1
                if entry.detached and not entry.writers:
                    self._free_locked(entry)
        return whole

    def commit(
        self,
        entries: list[Entry],
        checksums: list[bytes | None],
        tier_writers: int,
        tokens: StoreTokens | None = None,
    ) -> list[Entry]:
        """Make whole stored entries (see ``end_writes``) readable. Returns those still indexed, each holding
        ``tier_writers`` readers for the tier writes the caller submits next (``clear`` may have dropped the
        others meanwhile). ``tokens``: the store's, for its KV events (reported here, under the lock)."""
        kept = []
        with self.lock:
            for entry, checksum in zip(entries, checksums, strict=True):
                self._forget_partial_locked(entry)
                entry.writers -= 1
                entry.checksum = checksum
                entry.state = State.RESIDENT
                if entry.detached:
                    self._free_locked(entry)
                    continue
                entry.readers += tier_writers
                self.policy.insert(entry.key)
                kept.append(entry)
            if self.events is not None and tokens is not None and kept:
                self.events.stored(kept, tokens)
            if self._written_waiters:
                self._written.notify_all()
        return kept

    def abort(self, entries: list[Entry]) -> None:
        """Undo ``reserve`` for entries whose copy failed (an object assembled from slices goes whole: one of
        them is bad); the memory goes back once no other store writes into it."""
        with self.lock:
            for entry in entries:
                entry.writers -= 1
                if not entry.detached:
                    self.index.pop(entry.key)
                    self._forget_partial_locked(entry)
                    entry.detached = True  # a store waiting for it (await_written) sees it gone
                if not entry.writers:
                    self._free_locked(entry)
            if self._written_waiters:
                self._written.notify_all()

    def drop_late(self, entries: list[Entry]) -> None:
        """Undo ``reserve`` for entries whose copy ended after their caller stopped waiting (its blocks may have
        held other KV by then)."""
        self.abort(entries)
        with self.lock:
            self.counters.late_chunks += len(entries)

    # --- whole-cache operations ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every object and lookup lock; objects in use (read leases too) are freed when their copy finishes."""
        with self.lock:
            self.leases.release_all()
            for entry in self.index:
                self.detach_locked(entry)

    # --- internals (lock held) ----------------------------------------------------------------------------

    def _forget_partial_locked(self, entry: Entry) -> None:
        if self._partials.get(entry.key) is entry:  # a newer object of the same key may be assembling
            del self._partials[entry.key]
