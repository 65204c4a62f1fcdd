"""A store's chunks into the pool, in one of two orders of work.

In order: keys, then pool objects for the chunks not present, then their copy. Ahead (GPU engines with a pinned
pool): the copy of every chunk after the skipped ones is enqueued first, and the keys and index entries are made
while the bytes move. On the GPU host the CPU time before a store's first GPU operation was most of a one-chunk
store's overhead, and after idling (or any other work) that CPU time is several times its warm cost: every module
the path touches comes back from memory. Ahead takes the keys and the index off that path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from kvferry.cache.chunk_copies import copies_in_background, copy_chunks, head_masks
from kvferry.cache.event_hooks import StoreTokens
from kvferry.cache.index import Entry
from kvferry.cache.keys import CacheNamespace, ChunkHasher, TokenIds, token_view
from kvferry.cache.request import check_skip, select_blocks, token_count
from kvferry.cache.residency import Residency
from kvferry.cache.steps import Enqueued, Steps
from kvferry.cache.tails import superseded
from kvferry.formats import KVGeometry
from kvferry.transfer import Direction
from kvferry.transfer.api import transfer_pool_at_async
from kvferry.transfer.block_ids import BlockIds, CheckedBlockIds, check_block_ids

if TYPE_CHECKING:
    from kvferry.cache.tiering import TierLink
    from kvferry.transfer.handle import TransferHandle


class Write(NamedTuple):
    """A store's chunks being written: their entries (WRITING) and the chunk each holds, their copy in flight
    (None: done already), the objects copied into for chunks found present (freed once the copy is done), when
    the copy started, and the chunks (by index) found WRITING for another store."""

    entries: list[Entry]
    chunks: list[int]
    in_flight: TransferHandle | None
    spare: list[torch.Tensor]
    started: float
    others: list[tuple[int, Entry]]


class ChunkWriter:
    """Writes a store's new chunks into the pool and makes them readable. Thread-safe (state is in `Residency`)."""

    AHEAD_PAUSE = 64  # stores made in order after a store ahead copied a chunk that was present

    def __init__(
        self,
        residency: Residency,
        hasher: ChunkHasher,
        chunk_size: int,
        checksum: Callable[[torch.Tensor], bytes] | None,
        tiers: TierLink | None,
        in_flight_wait_s: float = 0.0,
    ) -> None:
        self._res = residency
        self._in_flight_wait_s = in_flight_wait_s
        self._pool = residency.pool
        self._hasher = hasher
        self._chunk_size = chunk_size
        self._checksum = checksum
        self._tiers = tiers
        self._ahead_pause = 0  # stores left to make in order (a plain int: a lost update under a race is harmless)

    def store_steps(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        paged: Any,
        geom: KVGeometry,
        block_ids: BlockIds,
        skip_prefix_tokens: int,
        valid_until: float | None,
        tail: bool,
        pages: bool = False,
    ) -> Steps[int]:
        """A store request (`CacheEngine.store_steps`, its geometry checked): its block ids checked, its new full
        chunks written, then its tail where asked for; the tails they supersede dropped; the counters. Returns the
        tokens stored."""
        n_tokens = token_count(tokens)
        skip = check_skip(skip_prefix_tokens, n_tokens)
        if pages and (skip or tail):
            raise ValueError("a store of pages stores each of them, with no tail (skip_prefix_tokens 0, tail False)")
        first = skip // self._chunk_size
        per_chunk = self._chunk_size // geom.bs
        n_full = self._hasher.num_chunks(tokens)
        tail_len = (n_tokens - n_full * self._chunk_size) // geom.bs * geom.bs if tail else 0
        # Whether or not a chunk turns out to need a copy, every block a copy could read is checked now (once: the
        # transfer takes the checked ids as they are).
        needed = n_full * per_chunk + tail_len // geom.bs
        ids = check_block_ids(block_ids, geom.nb, geom.bs, needed=needed, start=first * per_chunk, distinct=False)
        with_tail = bool(tail_len) and n_full * self._chunk_size + tail_len > skip
        entries, seconds = yield from self.write_steps(
            tokens, ns, paged, geom, ids, first, valid_until, more_after=with_tail, pages=pages
        )
        stored_tail = None
        if with_tail:
            stored_tail, more = self.write_tail(
                tokens, ns, paged, geom, ids, tail_len, valid_until, parent_skipped=first >= n_full > 0
            )
            seconds += more
        return self.account(tokens, ns, geom, first, entries, stored_tail, tail_len, seconds, pages)

    def account(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        geom: KVGeometry,
        first: int,
        entries: list[Entry],
        stored_tail: Entry | None,
        tail_len: int,
        seconds: float,
        pages: bool = False,
    ) -> int:
        """After a store's chunks from ``first`` on and its tail (``tail_len`` tokens asked for) were written: the
        tails they supersede dropped, the counters. Returns the tokens stored."""
        if self._res.index.has_tails and not pages:  # tails the chunks and tail just stored supersede go first
            self._res.demote(superseded(self._res.index, self._hasher.prefix(tokens, ns), first, tail_len))
        share = geom.width / geom.object_width  # this engine's heads
        tail_tokens = stored_tail.tail if stored_tail is not None else 0
        counters = self._res.counters
        with self._res.lock:
            counters.stores += 1
            if entries or tail_tokens:
                counters.stored_chunks += len(entries) + (tail_tokens > 0)
                counters.stored_tail_tokens += tail_tokens
                counters.stored_bytes += int(
                    geom.bytes_per_token * (len(entries) * self._chunk_size + tail_tokens) * share
                )
                counters.store_seconds += seconds
        return len(entries) * self._chunk_size + tail_tokens

    def write_steps(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        paged: Any,
        geom: KVGeometry,
        block_ids: CheckedBlockIds,
        first: int,
        valid_until: float | None = None,
        more_after: bool = False,
        pages: bool = False,
    ) -> Steps[tuple[list[Entry], float]]:
        """Store the full chunks of ``tokens`` from chunk ``first`` on that are not present; returns the new
        (now readable) entries and the seconds their copy took. ``block_ids`` was checked to cover them. A copy
        that ends after ``valid_until`` (time.time()) is dropped: see ``CacheEngine.store``. Yields once, when the
        copy is enqueued (`kvferry.cache.steps`); its count is final unless chunks in flight for a concurrent
        store of the same prefix must be waited for, or ``more_after`` (the caller writes a tail after them).
        ``pages``: each chunk is keyed as a one-chunk prefix of its own (`keys_after`)."""
        n_full = self._hasher.num_chunks(tokens)
        write = None
        if first < n_full and copies_in_background(geom, self._pool) and not geom.partial_heads:
            if self._ahead_pause:
                self._ahead_pause -= 1
            else:
                write = self._ahead(tokens, ns, geom, block_ids, first, n_full, pages)
        if write is None:
            write = self._in_order(tokens, ns, paged, geom, block_ids, first, pages)
        stored: list[Entry] = []
        seconds = 0.0
        try:
            yield Enqueued(write.in_flight, len(write.entries) * self._chunk_size, not (write.others or more_after))
        finally:  # also when the steps are closed early: the copy is waited for and its chunks settled
            if write.entries or write.spare:
                stored, seconds = self.finish(write, valid_until, tokens, ns)
        if not write.others:
            return stored, seconds
        taken, more = self._take_over(tokens, ns, paged, geom, block_ids, write.others, valid_until, pages)
        return stored + taken, seconds + more

    def _take_over(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        paged: Any,
        geom: KVGeometry,
        block_ids: CheckedBlockIds,
        others: list[tuple[int, Entry]],
        valid_until: float | None,
        pages: bool,
    ) -> tuple[list[Entry], float]:
        """Chunks this store found in flight for a concurrent store of the same prefix: wait for them (up to
        ``in_flight_wait_s``), and store from its own blocks those whose store failed meanwhile. Otherwise the
        failure of the first store would leave the prefix uncached though the second held every byte of it."""
        deadline = time.monotonic() + self._in_flight_wait_s
        stored: list[Entry] = []
        seconds = 0.0
        while others:
            lost = self._res.await_written(others, deadline)
            if not lost:
                break
            write = self._in_order(tokens, ns, paged, geom, block_ids, min(lost), pages)
            if write.entries:
                kept, more = self.finish(write, valid_until, tokens, ns)
                stored += kept
                seconds += more
            others = write.others
        return stored, seconds

    def _ahead(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        geom: KVGeometry,
        block_ids: CheckedBlockIds,
        first: int,
        n_full: int,
        pages: bool,
    ) -> Write | None:
        """The copy of chunks ``first..n_full-1`` enqueued before their keys are made, into objects from the pool's
        free room, evicted for where it is short (None: still short; store in order). A chunk found present gives
        its object back after the copy, and pauses this for the next ``AHEAD_PAUSE`` stores: a caller that
        re-stores what is cached would otherwise copy it for nothing every time (and evict for it)."""
        n = n_full - first
        shape = geom.object_shape(self._chunk_size)
        addresses = self._reserve(shape, geom.object_dtype, n)
        if addresses is None:
            return None
        per_chunk = self._chunk_size // geom.bs
        started = time.perf_counter()
        try:
            ids = block_ids[first * per_chunk : n_full * per_chunk]
            in_flight = transfer_pool_at_async(geom, addresses, ids, Direction.D2H, self._chunk_size, 0)
        except BaseException:
            self._free_addresses(addresses)
            raise
        try:
            objects = self._pool.views(addresses, shape, geom.object_dtype)
            parent, keys = self.keys_after(tokens, ns, first, pages)  # validates tokens
            nbytes = geom.bytes_per_token * self._chunk_size
            new, spare, others = self._res.index_written(keys, parent, objects, nbytes)
        except BaseException:
            try:
                in_flight.wait()
            finally:
                self._free_addresses(addresses)
            raise
        if spare:
            self._ahead_pause = self.AHEAD_PAUSE
        entries = [entry for _, entry in new]
        chunks = [first + i for i, _ in new]
        return Write(entries, chunks, in_flight, spare, started, [(first + i, e) for i, e in others])

    def _reserve(self, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> list[int] | None:
        """Pool memory for ``n`` objects (their addresses: the views are carved after the enqueue), evicting first
        where the pool's free room is short (None: still short). A full pool keeps free only what the watermark
        leaves, less than one long prompt's store: without this every such store would go in order."""
        needed = n * self._pool.allocation_bytes(shape, dtype)
        if self._pool.free_bytes < needed:
            self._res.make_room(needed)
        addresses = self._pool.try_reserve_many(shape, dtype, n)
        if len(addresses) < n:
            self._free_addresses(addresses)
            return None
        return addresses

    def _in_order(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        paged: Any,
        geom: KVGeometry,
        block_ids: CheckedBlockIds,
        first: int,
        pages: bool,
    ) -> Write:
        """Keys, then objects for the chunks not present, then their copy (done on return unless on a GPU)."""
        parent, keys = self.keys_after(tokens, ns, first, pages)  # validates tokens, even when nothing is stored
        nbytes = geom.bytes_per_token * self._chunk_size
        shape = geom.object_shape(self._chunk_size)
        heads = head_masks(geom)
        new, others = self._res.reserve(keys, parent, shape, geom.object_dtype, nbytes, heads) if keys else ([], [])
        entries = [entry for _, entry in new]
        in_flight_elsewhere = [(first + i, entry) for i, entry in others] if others else others
        chunks = [first + i for i, _ in new]
        if not entries:
            return Write(entries, chunks, None, [], 0.0, in_flight_elsewhere)
        ids = select_blocks(block_ids, [first + i for i, _ in new], self._chunk_size // geom.bs)
        started = time.perf_counter()
        try:
            objects = cast("list[torch.Tensor]", [entry.obj for entry in entries])  # reserved entries hold objects
            in_flight = copy_chunks(self._pool, self._chunk_size, paged, geom, objects, ids, Direction.D2H, 0)
        except BaseException:
            self._res.abort(entries)
            raise
        return Write(entries, chunks, in_flight, [], started, in_flight_elsewhere)

    def finish(
        self, write: Write, valid_until: float | None, tokens: TokenIds, ns: CacheNamespace
    ) -> tuple[list[Entry], float]:
        """Evict back under the watermark while the bytes move, wait for them, make the new chunks readable (and
        start their tier writes); returns them and the copy's seconds. Past ``valid_until`` they are dropped."""
        entries, chunks, in_flight, spare, started, _ = write
        try:
            try:
                self._res.settle()
            finally:
                if in_flight is not None:
                    in_flight.wait()
        except BaseException:
            self._res.abort(entries)
            self._free(spare)
            raise
        seconds = time.perf_counter() - started
        self._free(spare)
        if valid_until is not None and time.time() > valid_until:
            self._res.drop_late(entries)
            return [], seconds
        whole = self._res.end_writes(entries)  # all of them, unless some are objects still missing head slices
        checksum = self._checksum
        checksums: list[bytes | None] = (
            [checksum(e.obj) if e.obj is not None else None for e in whole] if checksum else [None] * len(whole)
        )
        tiers = self._tiers
        writers = len(tiers.tiers) if tiers is not None and tiers.write_on_store else 0
        announce = None
        if self._res.events is not None:  # KV events: the stored chunks' token ids go with them
            announce = StoreTokens(token_view(tokens), entries, chunks, self._chunk_size, ns.group)
        kept = self._res.commit(whole, checksums, writers, announce)
        if writers:
            assert tiers is not None
            tiers.write_through(kept)
        return entries, seconds

    def keys_after(
        self, tokens: TokenIds, ns: CacheNamespace, first: int, pages: bool
    ) -> tuple[bytes | None, list[bytes]]:
        """The key of chunk ``first - 1`` (None for chunk 0) and the keys from ``first`` on: a prefix's chained
        keys, or with ``pages`` each page's key alone (`ChunkHasher.pages`). Entries link each to the one before
        either way: a store's pages are consecutive pages of one sequence (what lookups of pages never walk, and
        what KV events report)."""
        if not pages:
            return self._hasher.keys_after(tokens, ns, first)
        keys = self._hasher.pages(tokens, ns)
        return (keys.key(first - 1) if first else None), keys.keys(first)

    def write_tail(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        paged: Any,
        geom: KVGeometry,
        block_ids: CheckedBlockIds,
        length: int,
        valid_until: float | None = None,
        *,
        parent_skipped: bool = False,
    ) -> tuple[Entry | None, float]:
        """Store the tail object of ``length`` tokens after the full chunks of ``tokens`` (see
        `kvferry.cache.tails`) unless it is present, or its last full chunk is not cached (a lookup could never
        reach it); returns the new (readable) entry, or None, and the seconds its copy took. Waits for its copy.

        ``parent_skipped``: the store skipped that last chunk (its caller stored it before): its caller's earlier
        store may still be on another worker thread, not yet indexed, so the tail is stored whether or not the
        chunk is there yet (a chunk that never lands leaves the tail unreachable until evicted)."""
        prefix = self._hasher.prefix(tokens, ns)
        n = prefix.n
        parent = prefix.key(n - 1) if n else None
        if parent is not None and not parent_skipped and parent not in self._res.index:
            return None, 0.0
        key = prefix.tail_key(n, length)
        shape = geom.object_shape(length)
        nbytes = geom.bytes_per_token * length
        new, _ = self._res.reserve([key], parent, shape, geom.object_dtype, nbytes, head_masks(geom), tail=length)
        if not new:  # present, in flight for another store, or no room
            return None, 0.0
        entry = new[0][1]
        per_chunk = self._chunk_size // geom.bs
        ids = block_ids[n * per_chunk : n * per_chunk + length // geom.bs]
        started = time.perf_counter()
        try:
            assert entry.obj is not None  # a reserved entry holds its object
            in_flight = copy_chunks(self._pool, self._chunk_size, paged, geom, [entry.obj], ids, Direction.D2H, 0)
            if in_flight is not None:
                in_flight.wait()
        except BaseException:
            self._res.abort([entry])
            raise
        seconds = time.perf_counter() - started
        if valid_until is not None and time.time() > valid_until:
            self._res.drop_late([entry])
            return None, seconds
        self.commit_tail(entry)
        return entry, seconds

    def commit_tail(self, entry: Entry) -> None:
        """A tail object's copy is over: readable (once every head's slice is written)."""
        whole = self._res.end_writes([entry])  # not yet, while other ranks' head slices are missing
        checksums = [self._checksum(e.obj) if self._checksum and e.obj is not None else None for e in whole]
        self._res.commit(whole, checksums, 0)  # tails stay in the pool: no tier writes

    def _free(self, objects: list[torch.Tensor]) -> None:
        for obj in objects:
            self._pool.free(obj)

    def _free_addresses(self, addresses: list[int]) -> None:
        for address in addresses:
            self._pool.free_address(address)
