"""How a lookup answers: the readable run of a prefix in the pool (from a first chunk on, then a stored tail),
optionally locked against eviction, then the chunks after it that the tiers hold and start promoting."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

from kvferry.cache.index import readable_run
from kvferry.cache.keys import CacheNamespace, ChunkHasher, TokenIds
from kvferry.cache.residency import Residency
from kvferry.cache.tails import find_tail
from kvferry.cache.tiering import TierLink
from kvferry.futures import when_all


class Located(NamedTuple):
    """A prefix's objects in a shared pool, for a process that copies them itself (`CacheEngine.locate`)."""

    tokens: int  # prefix tokens the objects hold (full chunks, then a tail's)
    lease: int | None  # the read lease on them; None where nothing was located
    deadline: float  # time.monotonic() at which the lease ends: a copy must have ended before it
    objects: list[tuple[int, int]]  # each object's (byte offset in the pool's slab, tokens), in prefix order


class LookupResult(NamedTuple):
    hit_tokens: int  # prefix tokens ready in the host pool (full chunks, then a tail's tokens)
    pending_tokens: int  # further prefix tokens being promoted from a tier: ready once they land
    lock_id: int | None  # lookup lock on the hit chunks (lock=True and a hit): retrieve(lock_id=) ends it
    # locate=True: the hit's objects, and ``lock_id`` is their read lease (`Located.lease`)
    located: Located | None = None


class PrefixLookup:
    """Answers a lookup's prefix hit from the pool, then from the tiers. Thread-safe (state is in `Residency`)."""

    def __init__(self, residency: Residency, hasher: ChunkHasher, tiers: TierLink | None) -> None:
        self._res = residency
        self._hasher = hasher  # and its chunk size
        self._tiers = tiers

    def pool_then_tiers(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        lock: bool,
        block_size: int | None,
        first_chunk: int,
        locate: bool = False,
    ) -> tuple[LookupResult, Callable[[], LookupResult] | None]:
        """See `CacheEngine.lookup_pool`: the pool's answer, and a function that asks the tiers when they may
        hold the chunks after its hits."""
        prefix, chunk = self._hasher.prefix(tokens, ns), self._hasher.chunk_size
        index = self._res.index
        removals = index.removals  # read before the index: see CacheIndex
        first = min(max(first_chunk, 0), prefix.n)
        run = readable_run(index.get, prefix, first)  # a few keys and parent links, not every chunk's key
        if index.has_tails:  # the longest stored tail after the run (see kvferry.cache.tails)
            tail = find_tail(index, prefix, first + len(run), len(tokens), block_size or 1)
            run = run if tail is None else [*run, tail]
        located = None
        with self._res.lock:
            self._res.expire_locks_locked()
            hits = self._res.still_readable_locked(run, removals)
            n_hits = first + len(hits) - (1 if hits and hits[-1].tail else 0)  # full chunks
            hit_tokens = n_hits * chunk + (hits[-1].tail if hits else 0)
            lock_id = None
            if locate and hits:
                lock_id, deadline = self._res.lease_readers_locked(hits)
                offset_of = self._res.pool.offset_of
                objects = [(offset_of(entry.obj), entry.tail or chunk) for entry in hits if entry.obj is not None]
                located = Located(hit_tokens, lock_id, deadline, objects)
            elif lock and hits:
                lock_id = self._res.lock_entries_locked(hits)
            counters = self._res.counters
            counters.lookups += 1
            counters.hit_tokens += hit_tokens
            counters.miss_tokens += len(tokens) - hit_tokens
            counters.located_chunks += len(located.objects) if located else 0
        found = LookupResult(hit_tokens, 0, lock_id, located)
        tiers = self._tiers
        if tiers is None or n_hits == prefix.n:
            return found, None

        def below() -> LookupResult:
            parent = prefix.key(n_hits - 1) if n_hits else None  # only now the keys after the hits are wanted
            pending, _ = tiers.fall_through(prefix.keys(n_hits), parent)
            if not pending:
                return found
            # Chunks on their way up extend the full chunks, which the tail does not: it is left out (and the
            # located objects with it: the caller asks again once they landed).
            return found._replace(hit_tokens=n_hits * chunk, pending_tokens=pending * chunk, located=None)

        return found, below

    def locate(self, tokens: TokenIds, ns: CacheNamespace, block_size: int | None) -> Located:
        """See `CacheEngine.locate`: the pool's answer of a locating lookup, the tiers not asked."""
        found, _ = self.pool_then_tiers(tokens, ns, False, block_size, 0, locate=True)
        return found.located or Located(0, None, 0.0, [])

    def prefetch(self, tokens: TokenIds, ns: CacheNamespace) -> Future[int]:
        """See `CacheEngine.prefetch`."""
        keys = self._hasher.keys(tokens, ns)
        waits: list[Future[None]] = []
        if self._tiers is not None:
            with self._res.lock:
                hits = len(self._res.readable_prefix_locked(keys))
            _, waits = self._tiers.fall_through(keys[hits:], keys[hits - 1] if hits else None)
        return when_all(waits, lambda: self._pool_hits(keys))

    def _pool_hits(self, keys: list[bytes]) -> int:
        with self._res.lock:
            return len(self._res.readable_prefix_locked(keys)) * self._hasher.chunk_size
