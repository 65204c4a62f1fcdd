"""How a retrieve moves chunks: the readable run of a prefix, held against eviction while its copy runs, each
object's checksum verified where the cache keeps them, then one transfer for all of them into the engine's blocks."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from kvferry.cache.index import Entry, readable_run
from kvferry.cache.keys import CacheNamespace, ChunkHasher, TokenIds
from kvferry.cache.metrics import CacheCounters
from kvferry.cache.request import check_skip, token_count
from kvferry.cache.residency import Residency
from kvferry.cache.steps import Enqueued, Steps
from kvferry.cache.tails import find_tail
from kvferry.cache.writer import copies_in_background, copy_chunks
from kvferry.formats import KVGeometry
from kvferry.transfer import Direction
from kvferry.transfer.block_ids import BlockIds, PendingBlockIds, check_block_ids


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
    ) -> Steps[int]:
        """See `CacheEngine.retrieve_steps`: the tokens written, the lock ended whatever happens."""
        held: list[Entry] = []
        try:
            bs, chunk = geom.bs, self._chunk_size
            skip = check_skip(skip_prefix_tokens, token_count(tokens))
            first = skip // chunk
            per_chunk = chunk // bs
            needed = self._hasher.num_chunks(tokens) * per_chunk
            prefix, index = self._hasher.prefix(tokens, ns), self._res.index
            removals = index.removals
            run = readable_run(index.get, prefix, first)  # reads only: nothing is held or counted yet
            if len(run) == prefix.n - first and index.has_tails:  # every full chunk: then the longest tail
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
            in_flight = copy_chunks(self._res.pool, chunk, paged, geom, objects, copied, Direction.H2D, skip_blocks)
            try:
                yield Enqueued(in_flight, end_tokens - skip, in_flight is not None)
            finally:
                if in_flight is not None:
                    in_flight.wait()
            seconds = time.perf_counter() - started
            with self._res.lock:
                c = self._counters
                c.retrieves += 1
                c.retrieved_chunks += len(entries)
                c.retrieved_bytes += sum(e.nbytes for e in entries) * geom.width // geom.object_width
                c.retrieve_seconds += seconds
            return end_tokens - skip
        finally:
            self._res.release_readers(held)
            if lock_id is not None:
                self._res.release_lock(lock_id)

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
