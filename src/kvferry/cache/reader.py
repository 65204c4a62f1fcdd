"""How a retrieve moves chunks: the readable run of a prefix, held against eviction while its copy runs, each
object's checksum verified where the cache keeps them, then one transfer for all of them into the engine's blocks."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from kvferry.cache.chunk_copies import copies_in_background, copy_chunks
from kvferry.cache.index import Entry, readable_pages, readable_run
from kvferry.cache.keys import CacheNamespace, ChunkHasher, PageKeys, PrefixKeys, TokenIds
from kvferry.cache.metrics import CacheCounters
from kvferry.cache.request import check_skip, token_count
from kvferry.cache.residency import Residency
from kvferry.cache.steps import Enqueued, Steps
from kvferry.cache.tails import find_tail
from kvferry.formats import KVGeometry
from kvferry.transfer import Direction
from kvferry.transfer.api import lead_pool_retrieve
from kvferry.transfer.block_ids import BlockIds, PendingBlockIds, check_block_ids

if TYPE_CHECKING:
    from kvferry.transfer.lane import LeadDMA


class ChunkReader:
    """Reads a retrieve's chunks out of the pool. Thread-safe (state is in `Residency`)."""

    def __init__(
        self,
        residency: Residency,
        hasher: ChunkHasher,
        chunk_size: int,
        checksum: Callable[[torch.Tensor], bytes] | None,
        counters: CacheCounters,
    ) -> None:
        self._res = residency
        self._hasher = hasher
        self._chunk_size = chunk_size
        self._checksum = checksum
        self._counters = counters

    def read_steps(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        paged: Any,
        geom: KVGeometry,
        block_ids: BlockIds,
        skip_prefix_tokens: int,
        lock_id: int | None,
        pages: bool = False,
    ) -> Steps[int]:
        """See `CacheEngine.retrieve_steps`: the tokens written, the lock ended whatever happens."""
        held: list[Entry] = []
        early: tuple[list[Entry], LeadDMA] | None = None
        try:
            bs, chunk = geom.bs, self._chunk_size
            skip = check_skip(skip_prefix_tokens, token_count(tokens))
            first = skip // chunk
            per_chunk = chunk // bs
            needed = self._hasher.num_chunks(tokens) * per_chunk
            index = self._res.index
            prefix = self._hasher.pages(tokens, ns) if pages else self._hasher.prefix(tokens, ns)
            if pages and skip:
                raise ValueError(f"skip_prefix_tokens={skip}: a retrieve of pages loads each of them")
            removals = index.removals
            if skip == first * chunk and copies_in_background(geom, self._res.pool) and prefix.n > first:
                early = self._lead(prefix, first, geom)
            # Reads only: nothing is held or counted yet.
            if isinstance(prefix, PageKeys):
                run = readable_pages(index.get, prefix)
            else:
                run = readable_run(index.get, prefix, first)
            if isinstance(prefix, PrefixKeys) and len(run) == prefix.n - first and index.has_tails:  # then a tail
                tail = find_tail(index, prefix, prefix.n, token_count(tokens), bs)
                if tail is not None:
                    needed += tail.tail // bs
                    run.append(tail)
            # Checked whole, hit or miss (a retrieve that misses is refused for the same ids as one that hits), with
            # a tail's blocks when one was found, once: the transfer takes the checked ids as they are. A GPU engine
            # checks them itself once its first DMAs into staging are in flight (they touch no KV): before that
            # DMA, a 16-chunk load's check is ~0.1 ms of host time on the path to its first GPU operation.
            check = functools.partial(
                check_block_ids, block_ids, geom.nb, bs, needed=needed, start=skip // bs, distinct=True
            )
            ids = None if copies_in_background(geom, self._res.pool) else check()
            held = self._res.acquire_readers(run, removals)
            entries = self._verified(held)
            last_tail = entries[-1].tail if entries else 0
            end_tokens = (first + len(entries)) * chunk - (chunk - last_tail if last_tail else 0)
            if not entries or end_tokens <= skip:
                if ids is None:
                    check()
                with self._res.lock:
                    self._counters.retrieves += 1
                return 0
            started = time.perf_counter()
            objects = cast("list[torch.Tensor]", [entry.obj for entry in entries])  # readable entries hold objects
            skip_blocks = (skip - first * chunk) // bs
            part = slice(first * per_chunk, end_tokens // bs)
            copied = ids[part] if ids is not None else PendingBlockIds(part.stop - part.start, lambda: check()[part])
            # The lead goes with the request whatever its first chunk turned out to be: the engine uses it only where
            # it is exactly the first slice's DMA (another first chunk has another address: the held one's memory
            # cannot be reused meanwhile), and a lead that is not handed on would keep the lane from this request.
            lead = early[1] if early is not None else None
            in_flight = copy_chunks(
                self._res.pool, chunk, paged, geom, objects, copied, Direction.H2D, skip_blocks, lead
            )
            # What needs no copy to have ended runs while it moves: the readers now hold what the lock held.
            if lock_id is not None:
                self._res.release_lock(lock_id)
                lock_id = None
            moved = sum(e.nbytes for e in entries) * geom.width // geom.object_width
            try:
                yield Enqueued(in_flight, end_tokens - skip, in_flight is not None, landed=True)
            finally:
                if in_flight is not None:
                    in_flight.wait()
            seconds = time.perf_counter() - started
            with self._res.lock:  # counted, and the readers let go, under one hold of the lock
                c = self._counters
                c.retrieves += 1
                c.retrieved_chunks += len(entries)
                c.retrieved_bytes += moved
                c.retrieve_seconds += seconds
                for entry in held:
                    self._res.release_reader_locked(entry)
                held = []
            return end_tokens - skip
        finally:
            if early is not None:
                early[1].release()
                held += early[0]
            if held:
                self._res.release_readers(held)
            if lock_id is not None:
                self._res.release_lock(lock_id)

    def _lead(self, prefix: PageKeys | PrefixKeys, first: int, geom: KVGeometry) -> tuple[list[Entry], LeadDMA] | None:
        """The first DMA of a GPU retrieve of ``prefix``'s chunks from ``first`` on, started before the others are
        looked up (a load's hashing, index walk and checks then overlap it): the chunk at ``first``, and for pages,
        where the first slice joins several objects, the pages after it whose objects lie back to back with it
        (looked up only then: pages a store wrote together; their keys are remembered from the lookup, where a
        prefix's next keys would each be hashed first), with a reader held on each until the retrieve ends; None
        where it does not apply (a miss there, a tail, a slice of the heads, coded objects). The engine uses it only
        where it is the start of the request's first slice."""
        index = self._res.index
        entry = index.get(prefix.key(first))
        obj = entry.obj if entry is not None else None
        if entry is None or obj is None or entry.tail or geom.partial_heads or geom.codec is not None:
            return None
        if geom.device.type != "cuda":  # a GPU engine's DMA
            return None
        held = self._res.acquire_readers([entry])
        if not held:
            return None
        nbytes, n_chunks = obj.nbytes, prefix.n - first

        def following(count: int) -> list[int]:
            found = []
            for i in range(first + 1, min(first + 1 + count, prefix.n)):
                other = index.get(prefix.key(i))
                if other is None or other.obj is None or other.tail or other.obj.nbytes != nbytes:
                    break
                found.append(other)
            more = self._res.acquire_readers(found)
            held.extend(more)
            return [other.obj.data_ptr() for other in more if other.obj is not None]

        try:
            shape = obj.shape
            more = following if isinstance(prefix, PageKeys) else None
            lead = lead_pool_retrieve(geom, obj.data_ptr(), nbytes, shape[0] * shape[1], n_chunks, more)
        except BaseException:
            self._res.release_readers(held)
            raise
        if lead is None:
            self._res.release_readers(held)
            return None
        return held, lead

    def _verified(self, entries: list[Entry]) -> list[Entry]:
        """The leading ``entries`` whose checksum matches; the first that fails is dropped from the cache."""
        if self._checksum is None:
            return entries
        for i, entry in enumerate(entries):
            assert entry.obj is not None
            if self._checksum(entry.obj) != entry.checksum:
                with self._res.lock:
                    self._counters.checksum_failures += 1
                    self._res.detach_locked(entry)
                return entries[:i]
        return entries
