"""Sliding-window and chunked-local groups' chunks: which a hit needs, and which a newer boundary supersedes.

A hit of ``end`` tokens needs a windowed group's chunks from `KVGroup.first_loaded_chunk` on only: vLLM allocates the
group nothing before the window at the hit's end (its null block), so the load reads nothing before it. So such a
group's lookup asks for those chunks only (`GroupedLookups`, embedded mode: a server's lookups ask for every chunk
from token 0), and once a store reaches a boundary, the chunks before its window are *superseded*: no lookup
ending there or later needs them, only one ending at an earlier boundary (another prompt that shares less of the
prefix, a repeat of a shorter one). They are worth less than full-attention chunks, which every longer hit needs,
so they go to the front of the eviction order (`CacheEngine.demote`, as superseded tails do), not away: a lookup
ending at an earlier boundary still finds them while the pool has room.

They are demoted once the request's stores have all ended (`WorkerSide` demotes what `superseded` names then), not
as the windowed store ends: demoted at once, they were the first objects the same request's full-attention stores
evicted whenever the pool was short, and the request's chunks left before it was reported stored (a chunk a group
has lost is no hit, and KV events never announced it).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvferry.cache.keys import TokenIds
from kvferry.connector.backends import Backend, Hit
from kvferry.connector.kv_groups import KVGroup


class WindowedBackend:
    """A windowed group's backend: lookups from a chunk on, and the demotion of what its stores supersede."""

    def __init__(self, backend: Backend, group: KVGroup, *, demote_superseded: bool = True) -> None:
        self.backend = backend
        self.group = group
        self.demote_superseded = demote_superseded

    @property
    def chunk_size(self) -> int | None:
        return self.backend.chunk_size

    def lookup(self, tokens: TokenIds, first_chunk: int = 0) -> Hit | None:
        return self.backend.lookup(tokens, first_chunk)

    def free_lock(self, lock: Any) -> None:
        self.backend.free_lock(lock)

    def retrieve_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self.backend.retrieve_async(tokens, block_ids, skip_prefix_tokens)

    def retrieve(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> int:
        return self.backend.retrieve(tokens, block_ids, skip_prefix_tokens)

    def store_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self.backend.store_async(tokens, block_ids, skip_prefix_tokens)

    def superseded(self, tokens: TokenIds, skip_prefix_tokens: int) -> range:
        """The chunks a store of ``tokens`` (after ``skip_prefix_tokens``) supersedes, to demote once the request's
        stores have ended: those before the window at the store's end that the window at its start (what earlier
        stores of the request reached) still needed. Empty when stores do not demote."""
        chunk = self.chunk_size
        if not self.demote_superseded or chunk is None:
            return range(0)
        first = self.group.first_loaded_chunk
        return range(first(skip_prefix_tokens, chunk), first(len(tokens) // chunk * chunk, chunk))

    def demote(self, tokens: TokenIds, chunks: range) -> None:
        self.backend.demote(tokens, chunks)

    def close(self) -> None:
        self.backend.close()
