"""Tail objects: the tokens after a prefix's last full chunk, kept so the next, longer prompt reuses them too.

A chat's next turn is the previous prompt, its answer and new text: only whole chunks would leave up to a chunk
of the previous turn to recompute. So a store may also write its last partial chunk as a *tail object* of exactly
those tokens (a whole number of the storing engine's blocks), and a lookup returns the longest stored prefix at
block granularity: its full chunks, then the longest readable tail after them whose tokens are the lookup's.

Why a separate object rather than chunks that grow in place: an object's bytes never change once readable (a
reader holds no lock on its contents, tiers and other engines may hold copies), and keys stay a function of the
token prefix. What it costs:

- the pool: a tail object holds only its own tokens (the copy path takes a partial last object), so a tail costs
  what its tokens cost; a superseded tail (see below) is the first to be evicted.
- a lookup: one dict get for the lengths stored after its last full chunk (``CacheIndex.tail_lengths``) and one
  hash of at most a chunk of tokens per length tried, longest first; nothing when no tail is stored there.
- tiers: none. Tails stay in the pool: a tier write is a whole object's I/O for less than a chunk of tokens that
  the next turn supersedes, so an evicted tail is dropped, and lookups below the pool ask for chunks only.

A tail is *superseded* once a store writes the full chunk or a longer tail that starts with its tokens: it is
then worth less than what replaced it (only a repeat of exactly the older prompt still reads it), so it moves to
the front of the eviction order rather than being dropped at once (a lookup may hold it locked).
"""

from __future__ import annotations

from kvferry.cache.index import RESIDENT, SPILLING, CacheIndex, Entry
from kvferry.cache.keys import PrefixKeys


def find_tail(index: CacheIndex, prefix: PrefixKeys, chunks: int, tokens: int, block_size: int) -> Entry | None:
    """The longest readable tail after the first ``chunks`` full chunks of ``prefix``'s tokens that the lookup's
    ``tokens`` cover, a whole number of ``block_size``-token blocks; None when there is none. Reads the index
    without the lock (as ``readable_run``): the caller re-checks the entry under it."""
    parent = prefix.key(chunks - 1) if chunks else None
    room = tokens - chunks * prefix.chunk_size
    for length in index.tail_lengths(parent):
        if length > room or length % block_size:
            continue
        entry = index.get(prefix.tail_key(chunks, length))
        if entry is not None and entry.tail == length and (entry.state is RESIDENT or entry.state is SPILLING):
            return entry
    return None


def superseded(index: CacheIndex, prefix: PrefixKeys, first: int, tail: int) -> list[bytes]:
    """Keys of the stored tails that a store of ``prefix``'s full chunks from ``first`` on and a tail of ``tail``
    tokens after them (0: none) supersedes: those whose tokens begin the chunk or the longer tail after the same
    parent. Hashes only where a tail is stored; nothing at all while the index holds no tail."""
    if not index.has_tails:
        return []
    keys: list[bytes] = []
    end = prefix.n + (1 if tail else 0)
    if first >= end:
        return keys
    # The parent of chunk m is parents[m - first]: one pass over the tokens for all of them.
    parents: list[bytes | None] = [None] if first == 0 else []
    parents += prefix.keys(max(first - 1, 0))
    for m in range(first, end):
        longer = prefix.chunk_size if m < prefix.n else tail
        for length in index.tail_lengths(parents[m - first]):
            if length < longer:
                key = prefix.tail_key(m, length)
                entry = index.get(key)
                if entry is not None and entry.tail == length:
                    keys.append(key)
    return keys
