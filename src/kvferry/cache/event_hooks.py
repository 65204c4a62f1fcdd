"""Where the cache's KV events come from: hooks that turn objects entering and leaving a medium into records.

The host pool (medium CPU): an object enters when a store commits it or a promotion lands (the two ways an entry
becomes readable) and leaves when it leaves the index while readable (``CacheIndex.pop``: evicted, spilled and
dropped, cleared, failed its checksum), so each stay is reported once, in the order the pool's lock saw. The hooks
run under that lock and only append a record to the `EventQueue` (a full queue drops it, counted). Tails
(`kvferry.cache.tails`) are not reported: they are not whole chunks.

The tiers (medium STORAGE): each reports through `Tier.watch` what it gains and loses, under its own lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING

from kvferry.cache.event_queue import EventQueue
from kvferry.cache.events import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllCleared,
    ChunksRemoved,
    ChunksStored,
    Record,
    prefix_digests,
)
from kvferry.cache.index import Entry
from kvferry.tiers import Tier
from kvferry.tiers.held import HeldListener, HeldObjects

if TYPE_CHECKING:
    from kvferry.cache.residency import Residency


class StoreTokens:
    """A store's token ids (little-endian uint32 bytes), the chunk each of its new entries holds, the KV cache group
    of its key space (`CacheNamespace.group`), and the chained digest before each chunk (made here, off the pool's
    lock the hooks run under)."""

    __slots__ = ("chain", "chunk_of", "data", "group", "step")

    def __init__(
        self, data: memoryview, entries: Sequence[Entry], chunks: Sequence[int], chunk_size: int, group: str | None
    ) -> None:
        self.data = data
        self.step = chunk_size * 4
        self.chunk_of = dict(zip(entries, chunks, strict=True))
        self.group = group
        self.chain = prefix_digests(data, self.step, max(chunks, default=0))  # [i]: of the tokens before chunk i


class CacheEvents:
    """The hooks of one cache engine, publishing into ``queue``."""

    def __init__(self, queue: EventQueue) -> None:
        self.queue = queue

    def stored(self, entries: list[Entry], tokens: StoreTokens) -> None:
        """A store made ``entries`` readable (lock held): one record per run of consecutive chunks."""
        run: list[Entry] = []
        first = last = -1
        for entry in entries:
            chunk = tokens.chunk_of[entry]
            if run and chunk != last + 1:
                self._put_run(run, tokens, first)
                run = []
            if not run:
                first = chunk
            run.append(entry)
            last = chunk
        if run:
            self._put_run(run, tokens, first)

    def _put_run(self, run: list[Entry], tokens: StoreTokens, first: int) -> None:
        ids = tokens.data[first * tokens.step : (first + len(run)) * tokens.step].tobytes()
        keys = tuple(e.key for e in run)
        self.queue.put(ChunksStored(keys, run[0].parent, ids, MEDIUM_CPU, LOCAL, tokens.group, tokens.chain[first]))

    def promoted(self, entry: Entry) -> None:
        """A promotion from a tier made ``entry`` readable (lock held); the tier kept no token ids."""
        if not entry.tail:
            self.queue.put(ChunksStored((entry.key,), entry.parent, b"", MEDIUM_CPU, LOCAL))

    def removed(self, entry: Entry) -> None:
        """``entry`` left the index (lock held); reported if it was readable, so once per stay in the pool."""
        if not entry.tail and entry.readable:
            self.queue.put(ChunksRemoved((entry.key,), MEDIUM_CPU, LOCAL))

    def tier_listener(self, locality: str) -> HeldListener:
        put = self.queue.put

        def changed(stored: list[bytes], removed: list[bytes]) -> None:
            if stored:
                put(ChunksStored(tuple(stored), None, b"", MEDIUM_STORAGE, locality))
            if removed:
                put(ChunksRemoved(tuple(removed), MEDIUM_STORAGE, locality))

        return changed


class EventSource:
    """A cache's pool and tiers reporting into ``queue``: hooks on from construction, and ``resync`` to announce
    everything held (after a start, or after the queue dropped records)."""

    def __init__(self, residency: Residency, tiers: list[Tier], queue: EventQueue) -> None:
        self.queue = queue
        self._res = residency
        hooks = CacheEvents(queue)
        with residency.lock:
            residency.events = hooks
            residency.index.on_removed = hooks.removed
        self._tiers: list[tuple[str, HeldObjects]] = [
            (tier.locality, tier.watch(hooks.tier_listener(tier.locality))) for tier in tiers
        ]

    def resync(self) -> None:
        """Replace what is queued with ``AllCleared`` and a store for everything held. Under the pool's lock and
        every tier's, the locks the hooks report under: no record can fall between the snapshot and the queue."""
        with ExitStack() as locks:
            locks.enter_context(self._res.lock)
            for _, held in self._tiers:
                locks.enter_context(held.lock)
            records = announcement(list(self._res.index), [(locality, held.keys()) for locality, held in self._tiers])
            self.queue.replace([AllCleared(), *records])


def announcement(pool: list[Entry], tiers: list[tuple[str, list[bytes]]]) -> list[Record]:
    """What is held, as stores: the pool's readable chunks (each with its parent) and each tier's keys (by
    locality). Neither keeps token ids, so these carry none."""
    records: list[Record] = [
        ChunksStored((e.key,), e.parent, b"", MEDIUM_CPU, LOCAL) for e in pool if e.readable and not e.tail
    ]
    for locality, keys in tiers:
        records += [ChunksStored((key,), None, b"", MEDIUM_STORAGE, locality) for key in keys]
    return records
