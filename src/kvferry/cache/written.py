"""Stores another process copied itself: objects reserved in a shared pool (`CacheEngine.reserve_objects`), written
by an engine with its own transfer (in its own GPU context, no server thread in the copy), then handed over
(`CacheEngine.adopt_written`) and made readable as a store's objects are once its copy is over.

A reserved object is the pool's memory but no entry of the index: nothing reads or evicts it, and the pool counts
it used, until it is adopted (indexed, or freed where its chunk was present) or given back. Objects are named by
their byte offset in the pool (as `CacheEngine.locate` names them), which a process mapping it shares.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvferry.cache.index import Entry
from kvferry.cache.keys import CacheNamespace, ChunkHasher, TokenIds
from kvferry.cache.request import token_count
from kvferry.cache.residency import Residency
from kvferry.cache.writer import ChunkWriter, Write
from kvferry.formats import KVGeometry


class WrittenStores:
    """Reserves objects for stores copied elsewhere and adopts them once written. Thread-safe."""

    def __init__(self, writer: ChunkWriter, residency: Residency, hasher: ChunkHasher, chunk_size: int) -> None:
        self._writer = writer
        self._res = residency
        self._pool = residency.pool
        self._hasher = hasher
        self._chunk_size = chunk_size
        self._base = self._pool.slab.data_ptr()

    def reserve(self, geom: KVGeometry, count: int) -> list[int]:
        """Up to ``count`` objects of a whole chunk in ``geom``'s object shape (their offsets), evicting first
        where the pool's free room is short; fewer (maybe none) where it holds too much that is locked or in use."""
        if geom.partial_heads:
            raise ValueError("an engine holding a slice of the heads writes a slice of each object: it stores")
        shape, dtype = geom.object_shape(self._chunk_size), geom.object_dtype
        needed = count * self._pool.allocation_bytes(shape, dtype)
        if needed > self._pool.capacity_bytes // 2:
            raise ValueError(f"{count} objects ({needed:,} bytes) would hold over half the pool")
        if self._pool.free_bytes < needed:
            self._res.make_room(needed)
        return [address - self._base for address in self._pool.try_reserve_many(shape, dtype, count)]

    def give_back(self, offsets: Sequence[int]) -> None:
        """Free reserved objects that will not be adopted (ValueError for one that is not a live object)."""
        for offset in offsets:
            self._pool.free_address(self._base + offset)

    def adopt(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        geom: KVGeometry,
        first: int,
        offsets: Sequence[int],
        tail: tuple[int, int] | None,
    ) -> int:
        """The objects at ``offsets`` (reserved, now written) hold the full chunks of ``tokens`` from chunk
        ``first`` on, one each; ``tail``: (address, tokens) of the object holding the tokens after them, in a
        tail's shape at the start of its reserved object (the rest goes back to the pool). Each becomes
        readable as a store's would; one whose key is present is freed. Returns the tokens stored.

        ValueError, before anything is indexed or freed, where the objects do not match ``tokens``: the caller
        still owns them."""
        n_full = self._hasher.num_chunks(tokens)
        if not 0 <= first <= n_full or len(offsets) != n_full - first:
            raise ValueError(f"{len(offsets)} objects for chunks {first}..{n_full - 1} of {len(tokens)} tokens")
        tail_len = 0 if tail is None else tail[1]
        end = n_full * self._chunk_size + tail_len
        bad_tail = tail_len % geom.bs or not 0 < tail_len < self._chunk_size or end > token_count(tokens)
        if tail is not None and bad_tail:
            raise ValueError(f"a tail of {tail_len} tokens after {n_full} chunks of {len(tokens)} tokens")
        shape, dtype = geom.object_shape(self._chunk_size), geom.object_dtype
        addresses = [self._base + offset for offset in offsets]
        objects = self._pool.views(addresses, shape, dtype)  # each a live object of a whole chunk's bytes
        if tail is not None:
            self._pool.views([self._base + tail[0]], shape, dtype)
        parent, keys = self._writer.keys_after(tokens, ns, first, pages=False)
        started = time.perf_counter()
        new, spare, _ = self._res.index_written(keys, parent, objects, geom.bytes_per_token * self._chunk_size)
        entries = [entry for _, entry in new]
        write = Write(entries, [first + i for i, _ in new], None, spare, started, [])
        stored, seconds = self._writer.finish(write, None, tokens, ns)
        stored_tail = self._adopt_tail(tokens, ns, geom, first, tail) if tail is not None else None
        with self._res.lock:
            self._res.counters.adopted_stores += 1
        return self._writer.account(tokens, ns, geom, first, stored, stored_tail, tail_len, seconds)

    def _adopt_tail(
        self, tokens: TokenIds, ns: CacheNamespace, geom: KVGeometry, first: int, tail: tuple[int, int]
    ) -> Entry | None:
        """The tail object indexed, unless present or its last full chunk is not cached (a lookup could never reach
        it; as `ChunkWriter.write_tail`)."""
        address, length = self._base + tail[0], tail[1]
        prefix = self._hasher.prefix(tokens, ns)
        n = prefix.n
        parent = prefix.key(n - 1) if n else None
        if parent is not None and first < n and parent not in self._res.index:
            self._pool.free_address(address)
            return None
        shape = geom.object_shape(length)
        self._pool.shrink_to(address, shape, geom.object_dtype)
        obj = self._pool.views([address], shape, geom.object_dtype)[0]
        key = prefix.tail_key(n, length)
        new, spare, _ = self._res.index_written([key], parent, [obj], geom.bytes_per_token * length, tail=length)
        for extra in spare:
            self._pool.free(extra)
        if not new:
            return None
        entry = new[0][1]
        self._writer.commit_tail(entry)
        return entry
