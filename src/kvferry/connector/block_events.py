"""The engine's KV events for what kvferry holds of its requests, in the engine's own block hashes (engine-neutral).

A KV-aware router hashes prompts the way the engine does, so kvferry's blocks must reach it under the engine's
block hashes, not kvferry's chunk keys. `BlockEvents` maps one to the other and turns the cache's records
(`kvferry.cache.events`: chunk keys entering and leaving each medium) into `BlocksStored` / `BlocksRemoved` of the
engine's blocks:

- The scheduler half tells it which tokens a finished request stored and the engine's hashes of their blocks
  (`finished`), then that the worker reported those stores done (`stores_done`).
- The cache's records (`feed`: the cache's own queue in this process, or a server's event stream) carry each new
  chunk's key, its token ids and the chained digest of the tokens before it (`chain_digest`): each key is named
  by its whole prefix, in every key space that holds it (a split model's parts, another engine's model), whether
  or not the chunks before it were stored there. Each chunk of a store done is then announced in the engine's
  hashes in each medium that holds it (a busy pool may have spilled it to a tier before the worker reported the
  store; a chunk held nowhere by then is left out), and the keys remembered: a key leaving a medium removes its
  blocks there (once, whichever key of the blocks leaves first), a key entering another (a spill to a tier, a
  promotion back) announces them there.
- A chunk the cache has not named yet (its records lag the worker's report) is announced once they name it, for
  ``wait_s``; one never named (refused, or held since before this engine followed the cache, whose
  re-announcements carry no tokens) is not announced.
- A model of several KV cache groups (``groups``: each group's key space, `CacheNamespace.group`) has an object of
  each chunk per group: each group's blocks are announced and removed on their own, tagged with the group (what a
  hit needs of each is the engine's rule: every block before the hit of a full-attention group, the window's of a
  sliding-window one), as the engine's own events of such a model are.
- ``AllCleared`` (the cache dropped records, or the stream lost some): the announcement after it lists what is held
  still; blocks announced before that it no longer lists are removed.

Nothing here runs on a transfer's thread: `take` runs on the engine's scheduler thread once per step, and what
waits here is bounded (``max_pending`` stores, ``max_recent`` keys; beyond, the oldest is dropped and counted in
``dropped``: those blocks are then not announced, which a router reads as a miss, never as a wrong hit).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvferry.cache.events import (
    MEDIUM_CPU,
    PREFIX_ROOT,
    AllCleared,
    ChunksStored,
    Record,
    chain_digest,
    prefix_digests,
)
from kvferry.cache.keys import TokenIds, token_array

Where = tuple[str, str]  # (medium, locality)
_Name = tuple[bytes, str | None]  # a chunk key's prefix (`chain_digest` up to its end), its key space's group


class RecordFeed(Protocol):
    def take(self) -> list[Record]:
        """The cache's records since the last call, oldest first (never blocks)."""
        ...

    def close(self) -> None: ...

    @property
    def losses(self) -> int:
        """How often records were lost (each followed by an ``AllCleared`` and a re-announcement), since the start."""
        ...


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Blocks now held by kvferry in ``medium``, in the engine's hashes: ``parent`` is the hash of the block
    before the first (None: block 0), ``tokens`` their token ids (``block_size`` a block); ``group``: the KV cache
    group holding them (its place in `BlockEvents`' ``groups``; None: a model of one group)."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: tuple[int, ...]
    medium: str
    locality: str
    group: int | None = None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    hashes: tuple[bytes, ...]
    medium: str
    locality: str
    group: int | None = None


BlockEvent = BlocksStored | BlocksRemoved


@dataclass(slots=True)
class _Chunk:
    """One chunk's blocks as the engine names them (in one KV cache group), and the keys holding them in each
    medium."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: tuple[int, ...]
    group: int | None = None
    held: dict[Where, set[bytes]] = field(default_factory=dict)


@dataclass(slots=True)
class _Store:
    tokens: TokenIds
    hashes: list[bytes]
    since: float
    done: bool = False


@dataclass(slots=True)
class _Wanted:
    """A chunk of a store done that the cache's records have not named yet in ``places`` (groups, by place)."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: np.ndarray  # a view of the store's token array (a chunk's: made into ints once announced)
    places: set[int]
    until: float


class BlockEvents:
    """Engine block events for what kvferry holds of one engine's requests (see the module)."""

    def __init__(
        self,
        feed: RecordFeed,
        *,
        block_size: int,
        chunk_size: int,
        wait_s: float = 30.0,
        max_pending: int = 4096,
        max_recent: int = 65536,
        groups: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``groups``: a model of several KV cache groups, each group's key space (`CacheNamespace.group`) in the
        engine's order; none: one group, its chunks matched in whichever key space holds them."""
        if chunk_size % block_size:
            raise ValueError(f"chunk_size={chunk_size} must be a multiple of block_size={block_size}")
        self.feed = feed
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._wait_s = wait_s
        self._max_pending = max_pending
        self._max_recent = max_recent
        self._groups = tuple(groups)
        self._places: dict[str | None, int] = {group: place for place, group in enumerate(groups)}
        self._clock = clock
        self._by_prefix: dict[bytes, set[bytes]] = {}  # a chunk's prefix (`chain_digest`) -> the keys named by it
        # key -> its name, the latest ``max_recent`` keys: a name outlives the key's stay in the pool (a store may be
        # reported done after its chunks moved to a tier, or left)
        self._named: OrderedDict[bytes, _Name] = OrderedDict()
        self._media: dict[bytes, set[Where]] = {}  # a named key -> where it is held now
        self._chunks: dict[bytes, _Chunk] = {}  # key -> the engine's blocks it holds, while held somewhere
        self._recent: OrderedDict[bytes, _Chunk] = OrderedDict()  # keys held nowhere lately (a spill in flight)
        self._stores: OrderedDict[str, _Store] = OrderedDict()
        self._wanted: dict[bytes, list[_Wanted]] = {}  # a prefix -> chunks of stores done waiting for its key
        self._wanted_order: deque[tuple[float, bytes]] = deque()  # (until, prefix), oldest first
        self.dropped = 0  # stores or keys forgotten for want of room (their blocks not announced)

    def finished(self, req_id: str, tokens: Sequence[int], hashes: Sequence[bytes]) -> None:
        """A finished request's store of ``tokens`` (whole chunks of them count) was planned; ``hashes``: the
        engine's hash of each of its blocks."""
        whole = min(len(tokens) // self.chunk_size, len(hashes) * self.block_size // self.chunk_size)
        if whole == 0:
            return
        if len(self._stores) >= self._max_pending:
            self._stores.popitem(last=False)
            self.dropped += 1
        end = whole * self.chunk_size
        self._stores[req_id] = _Store(list(tokens[:end]), list(hashes[: end // self.block_size]), self._clock())

    def stores_done(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            store = self._stores.get(req_id)
            if store is not None:
                store.done = True

    def take(self) -> list[BlockEvent]:
        """The events since the last call: the cache's records applied, then the stores done matched."""
        out: list[BlockEvent] = []
        self._expire_wanted()
        self._apply(self.feed.take(), out)
        self._announce_done(out)
        return out

    def close(self) -> None:
        self.feed.close()

    # -- the cache's records --------------------------------------------------------------------------------

    def _apply(self, records: list[Record], out: list[BlockEvent]) -> None:
        cleared: _Cleared | None = None
        for record in records:
            if isinstance(record, AllCleared):
                if cleared is not None:  # a second one: the first's announcement ended before it
                    self._remember(cleared.removals(out))
                cleared = _Cleared(self._chunks, self._named)
                self._chunks, self._named, self._by_prefix, self._media = {}, OrderedDict(), {}, {}
            elif isinstance(record, ChunksStored):
                self._stored(record, out, cleared)
            else:
                if self._stores and any(key in self._named for key in record.keys):
                    # Stores done that wait for these chunks' records (which came in this same take) are announced
                    # before the chunks leave: a router then reads their whole history, not only the removal.
                    self._announce_done(out)
                self._removed(record.keys, (record.medium, record.locality), out)
        if cleared is not None:  # what the announcement after AllCleared did not list again has gone
            self._remember(cleared.removals(out))

    def _stored(self, record: ChunksStored, out: list[BlockEvent], cleared: _Cleared | None) -> None:
        where = (record.medium, record.locality)
        step = self.chunk_size * 4
        # A run from chunk 0 (no parent) starts at the root; a later one names its prefix (a cache that does not is
        # not followed for it: its chunks are not announced).
        prefix = record.prefix if record.prefix is not None or record.parent is not None else PREFIX_ROOT
        for i, key in enumerate(record.keys):
            if record.medium == MEDIUM_CPU:
                if prefix is not None and len(record.tokens) >= (i + 1) * step:
                    prefix = chain_digest(prefix, record.tokens[i * step : (i + 1) * step])
                    self._name(key, prefix, record.group)
                elif cleared is not None and key in cleared.named:
                    self._name(key, *cleared.named[key])  # re-announced: its tokens are the ones seen before
            if key in self._named:
                self._media.setdefault(key, set()).add(where)
            revived = cleared.revive(key, where) if cleared is not None else None
            if revived is not None:  # announced before the AllCleared and held still: nothing to say
                self._chunks[key] = revived
                continue
            chunk = self._chunks.get(key) or self._recent.pop(key, None)
            if chunk is not None:
                self._chunks[key] = chunk
                self._hold(chunk, key, where, out)
            name = self._named.get(key)
            if name is not None and name[0] in self._wanted:
                self._satisfy(name[0], out)

    def _removed(self, keys: Iterable[bytes], where: Where, out: list[BlockEvent]) -> None:
        for key in keys:
            media = self._media.get(key)
            if media is not None:
                media.discard(where)
            chunk = self._chunks.get(key)
            if chunk is None:
                continue
            if where in chunk.held:  # the first of its keys to leave takes the blocks with it
                for other in chunk.held.pop(where):
                    if other != key and not any(other in keys_ for keys_ in chunk.held.values()):
                        self._chunks.pop(other, None)
                        self._remember([(other, chunk)])
                out.append(BlocksRemoved(chunk.hashes, *where, chunk.group))
            if not any(key in keys_ for keys_ in chunk.held.values()):
                del self._chunks[key]
                self._remember([(key, chunk)])

    def _name(self, key: bytes, prefix: bytes, group: str | None) -> None:
        self._named[key] = (prefix, group)
        self._named.move_to_end(key)
        self._by_prefix.setdefault(prefix, set()).add(key)
        if len(self._named) > self._max_recent:
            old, (old_prefix, _) = self._named.popitem(last=False)
            self._media.pop(old, None)
            keys = self._by_prefix.get(old_prefix)
            if keys is not None:
                keys.discard(old)
                if not keys:
                    del self._by_prefix[old_prefix]

    def _remember(self, chunks: Iterable[tuple[bytes, _Chunk]]) -> None:
        for key, chunk in chunks:
            self._recent[key] = chunk
            if len(self._recent) > self._max_recent:
                self._recent.popitem(last=False)

    # -- stores done -------------------------------------------------------------------------------------------

    def _announce_done(self, out: list[BlockEvent]) -> None:
        """Announce the chunks of the stores reported done (those the cache's records have not named yet: once
        they do, `_satisfy`); forget stores never reported done."""
        now = self._clock()
        for req_id, store in list(self._stores.items()):
            if store.done:
                del self._stores[req_id]
                self._announce(store, out, now)
            elif now - store.since > self._wait_s * 10:  # never reported done: the engine dropped it
                del self._stores[req_id]

    def _announce(self, store: _Store, out: list[BlockEvent], now: float) -> None:
        per_chunk = self.chunk_size // self.block_size
        step = self.chunk_size * 4
        tokens = token_array(store.tokens)
        # as the cache's records name them, over token ids as little-endian uint32
        prefixes = prefix_digests(tokens.tobytes(), step, len(store.tokens) // self.chunk_size)
        for i, prefix in enumerate(prefixes[1:]):
            own = tokens[i * self.chunk_size : (i + 1) * self.chunk_size]
            wanted = _Wanted(tuple(store.hashes[i * per_chunk : (i + 1) * per_chunk]),
                             store.hashes[i * per_chunk - 1] if i else None, own,
                             set(range(max(1, len(self._groups)))), now + self._wait_s)  # fmt: skip
            wanted.places = {place for place in wanted.places if not self._announce_chunk(prefix, place, wanted, out)}
            if wanted.places:
                if len(self._wanted_order) >= self._max_recent:
                    self._expire_wanted(oldest=True)
                self._wanted.setdefault(prefix, []).append(wanted)
                self._wanted_order.append((wanted.until, prefix))

    def _announce_chunk(self, prefix: bytes, place: int, wanted: _Wanted, out: list[BlockEvent]) -> bool:
        """Announce ``wanted`` in group ``place`` where the keys named by ``prefix`` in its key space are held;
        whether any is named (held or not: a chunk let go before its store was reported is not waited for)."""
        keys = self._by_prefix.get(prefix, ())
        if self._groups:
            keys = {key for key in keys if self._places.get(self._named[key][1]) == place}
        if not keys:
            return False
        held = sorted(key for key in keys if self._media.get(key))
        chunk = next((self._chunks[key] for key in held if key in self._chunks), None)
        if chunk is None and held:
            own = tuple(wanted.tokens.tolist())  # plain ints: msgpack'd
            chunk = _Chunk(wanted.hashes, wanted.parent, own, place if self._groups else None)
        for key in held:
            assert chunk is not None  # found or made above
            self._chunks[key] = chunk
            for where in sorted(self._media[key]):
                self._hold(chunk, key, where, out)
        return True

    def _satisfy(self, prefix: bytes, out: list[BlockEvent]) -> None:
        """The cache's records named a key by ``prefix``: announce the chunks of stores done waiting for it."""
        waiting = self._wanted[prefix]
        for wanted in waiting:
            wanted.places = {place for place in wanted.places if not self._announce_chunk(prefix, place, wanted, out)}
        waiting[:] = [wanted for wanted in waiting if wanted.places]
        if not waiting:
            del self._wanted[prefix]

    def _expire_wanted(self, oldest: bool = False) -> None:
        """Stop waiting for chunks past their time (with ``oldest``, for the oldest one: no room, counted)."""
        now = self._clock()
        while self._wanted_order and (oldest or self._wanted_order[0][0] < now):
            until, prefix = self._wanted_order.popleft()
            waiting = self._wanted.get(prefix)
            if waiting is not None:
                kept = [wanted for wanted in waiting if wanted.until > until]
                if oldest and len(kept) < len(waiting):
                    self.dropped += 1
                if kept:
                    self._wanted[prefix] = kept
                else:
                    del self._wanted[prefix]
            oldest = False

    def _hold(self, chunk: _Chunk, key: bytes, where: Where, out: list[BlockEvent]) -> None:
        keys = chunk.held.get(where)
        if keys is None:
            chunk.held[where] = {key}
            out.append(BlocksStored(chunk.hashes, chunk.parent, chunk.tokens, *where, chunk.group))
        else:
            keys.add(key)


class _Cleared:
    """What was announced before an ``AllCleared``, while the announcement after it is read."""

    def __init__(self, chunks: dict[bytes, _Chunk], named: dict[bytes, _Name]) -> None:
        self.chunks = chunks
        self.named = named
        self._revived: dict[int, _Chunk] = {}  # by the old chunk's id: keys of one chunk stay one chunk

    def revive(self, key: bytes, where: Where) -> _Chunk | None:
        old = self.chunks.get(key)
        if old is None or key not in old.held.get(where, ()):
            return None
        new = self._revived.setdefault(id(old), _Chunk(old.hashes, old.parent, old.tokens, old.group))
        new.held.setdefault(where, set()).add(key)
        return new

    def removals(self, out: list[BlockEvent]) -> list[tuple[bytes, _Chunk]]:
        """Removes what was announced and not listed again; returns the keys now held nowhere (and their chunks)."""
        seen: set[int] = set()
        for old in self.chunks.values():
            if id(old) in seen:
                continue
            seen.add(id(old))
            new = self._revived.get(id(old))
            for where in old.held:
                if new is None or where not in new.held:
                    out.append(BlocksRemoved(old.hashes, *where, old.group))
            old.held.clear()  # the revived keys went to a new chunk
        return [(key, old) for key, old in self.chunks.items() if id(old) not in self._revived]
