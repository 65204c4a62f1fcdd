"""`BlockEvents` (kvferry.connector.block_events) against a hand-fed cache: the cache's records on chunk keys become
events on the engine's block hashes, each block stored and removed once per medium, in either order of a store's
report and its records, through a tier move, a split model's second key space, and an ``AllCleared``."""

from __future__ import annotations

import os
import random

import numpy as np

from kvferry.cache.events import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    PREFIX_ROOT,
    AllCleared,
    ChunksRemoved,
    ChunksStored,
    Record,
    chain_digest,
)
from kvferry.connector.block_events import BlockEvents, BlocksRemoved, BlocksStored

BS, CHUNK = 4, 8
PER = CHUNK // BS


class HandFeed:
    def __init__(self) -> None:
        self.records: list[Record] = []

    def take(self) -> list[Record]:
        records, self.records = self.records, []
        return records

    def close(self) -> None:
        return


def _request(seed: int, chunks: int) -> tuple[list[int], list[bytes], list[bytes]]:
    """Tokens, the engine's block hashes, and the cache's chunk keys (random: only their identity matters)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(1 << 20) for _ in range(chunks * CHUNK + 3)]  # and a partial chunk, never reported
    return tokens, [os.urandom(32) for _ in range(chunks * PER)], [os.urandom(32) for _ in range(chunks)]


def _stored(
    keys: list[bytes],
    tokens: list[int],
    first: int = 0,
    parent: bytes | None = None,
    group: str | None = None,
    prefix: bytes | None = None,
) -> ChunksStored:
    """The cache's record of a store's ``keys`` from chunk ``first`` on (``prefix``: of the chunks before)."""
    ids = np.asarray(tokens[first * CHUNK : (first + len(keys)) * CHUNK], dtype="<u4").tobytes()
    return ChunksStored(tuple(keys), parent, ids, MEDIUM_CPU, LOCAL, group, prefix)


def _prefix(tokens: list[int], chunks: int) -> bytes:
    """The chained digest of ``tokens``' first ``chunks`` chunks, as the cache's store records name it."""
    prefix = PREFIX_ROOT
    for i in range(chunks):
        prefix = chain_digest(prefix, np.asarray(tokens[i * CHUNK : (i + 1) * CHUNK], dtype="<u4").tobytes())
    return prefix


def _ledger() -> tuple[BlockEvents, HandFeed, list[float]]:
    feed, now = HandFeed(), [0.0]
    return BlockEvents(feed, block_size=BS, chunk_size=CHUNK, wait_s=5.0, clock=lambda: now[0]), feed, now


def test_a_store_is_announced_in_the_engines_hashes_whichever_comes_first() -> None:
    events, feed, _ = _ledger()
    tokens, hashes, keys = _request(1, 3)
    events.finished("a", tokens, hashes)
    assert events.take() == []  # not done yet
    events.stores_done(["a"])
    assert events.take() == []  # the cache has not reported the chunks yet (a server's stream lags)
    feed.records.append(_stored(keys, tokens))
    got = events.take()
    assert got == [
        BlocksStored(tuple(hashes[i * PER : (i + 1) * PER]), hashes[i * PER - 1] if i else None,
                     tuple(tokens[i * CHUNK : (i + 1) * CHUNK]), MEDIUM_CPU, LOCAL)
        for i in range(3)
    ]  # fmt: skip
    # another request storing the same prefix: nothing new; the eviction of chunk 1: its blocks, once
    events.finished("b", tokens[: 2 * CHUNK], hashes[: 2 * PER])
    events.stores_done(["b"])
    feed.records.append(ChunksRemoved((keys[1],), MEDIUM_CPU, LOCAL))
    feed.records.append(ChunksRemoved((keys[1],), MEDIUM_CPU, LOCAL))
    assert events.take() == [BlocksRemoved(tuple(hashes[PER : 2 * PER]), MEDIUM_CPU, LOCAL)]


def test_a_tier_move_a_second_key_space_and_all_cleared() -> None:
    events, feed, _ = _ledger()
    tokens, hashes, keys = _request(2, 2)
    other = [os.urandom(32) for _ in keys]  # a split model's other part: the same tokens under other keys
    feed.records += [_stored(keys, tokens), _stored(other, tokens)]
    events.finished("a", tokens, hashes)
    events.stores_done(["a"])
    assert [type(e) for e in events.take()] == [BlocksStored, BlocksStored]  # once per chunk, not per key space
    chunk0 = tuple(hashes[:PER])
    # a spill of chunk 0: removed from the pool, stored on the disk tier; then the second part's key leaves too
    feed.records += [
        ChunksRemoved((keys[0],), MEDIUM_CPU, LOCAL),
        ChunksStored((keys[0],), None, b"", MEDIUM_STORAGE, LOCAL),
        ChunksRemoved((other[0],), MEDIUM_CPU, LOCAL),
    ]
    got = events.take()
    assert got[0] == BlocksRemoved(chunk0, MEDIUM_CPU, LOCAL)
    assert isinstance(got[1], BlocksStored) and got[1].medium == MEDIUM_STORAGE and got[1].hashes == chunk0
    assert len(got) == 2
    # the cache dropped records: AllCleared, and the announcement lists chunk 0 on disk and chunk 1's first key
    feed.records += [AllCleared(), ChunksStored((keys[0],), None, b"", MEDIUM_STORAGE, LOCAL),
                     ChunksStored((keys[1],), None, b"", MEDIUM_CPU, LOCAL)]  # fmt: skip
    assert events.take() == []  # everything announced is held still
    feed.records += [AllCleared(), ChunksStored((keys[1],), None, b"", MEDIUM_CPU, LOCAL)]
    assert events.take() == [BlocksRemoved(chunk0, MEDIUM_STORAGE, LOCAL)]
    # two in one take: the first's announcement (chunk 0 on disk again) stands until the second, which lists none
    feed.records += [AllCleared(), ChunksStored((keys[0],), None, b"", MEDIUM_STORAGE, LOCAL), AllCleared()]
    assert events.take() == [BlocksStored(chunk0, None, tuple(tokens[:CHUNK]), MEDIUM_STORAGE, LOCAL),
                             BlocksRemoved(tuple(hashes[PER:]), MEDIUM_CPU, LOCAL),
                             BlocksRemoved(chunk0, MEDIUM_STORAGE, LOCAL)]  # fmt: skip


def test_a_store_the_cache_reports_in_part_is_announced_as_its_chunks_are_named() -> None:
    """Chunk 0 reported: announced at once. Chunk 1's record lags (a server's stream): announced when it comes.
    Chunk 2's comes after ``wait_s`` (or never: the pool refused it): not announced."""
    events, feed, now = _ledger()
    tokens, hashes, keys = _request(3, 3)
    feed.records.append(_stored(keys[:1], tokens))
    events.finished("a", tokens, hashes)
    events.stores_done(["a"])
    assert [e.hashes for e in events.take()] == [tuple(hashes[:PER])]
    now[0] = 4.0
    feed.records.append(_stored(keys[1:2], tokens, first=1, parent=keys[0], prefix=_prefix(tokens, 1)))
    assert [e.hashes for e in events.take()] == [tuple(hashes[PER : 2 * PER])]
    now[0] = 6.0  # past wait_s
    feed.records.append(_stored(keys[2:], tokens, first=2, parent=keys[1], prefix=_prefix(tokens, 2)))
    assert events.take() == []


def test_a_store_whose_chunks_come_and_go_in_one_take_is_announced_then_removed() -> None:
    """A server's stream read on its own thread hands over a store's records and their eviction (the next prompt's
    store) at once: the blocks are announced before they are removed, not lost in between."""
    events, feed, _ = _ledger()
    tokens, hashes, keys = _request(4, 2)
    events.finished("a", tokens, hashes)
    events.stores_done(["a"])
    assert events.take() == []
    feed.records += [_stored(keys, tokens), ChunksRemoved((keys[0], keys[1]), MEDIUM_CPU, LOCAL)]
    got = events.take()
    blocks = [tuple(hashes[:PER]), tuple(hashes[PER:])]
    assert [(type(e), e.hashes) for e in got] == [
        (BlocksStored, blocks[0]), (BlocksStored, blocks[1]), (BlocksRemoved, blocks[0]), (BlocksRemoved, blocks[1])
    ]  # fmt: skip
    assert events.take() == []


FULL, WINDOW = "group=0:full", "group=1:sliding_window:8"


def _hybrid(seed: int, chunks: int) -> tuple[BlockEvents, HandFeed, list[float], tuple[list[int], list[bytes]]]:
    feed, now = HandFeed(), [0.0]
    events = BlockEvents(feed, block_size=BS, chunk_size=CHUNK, wait_s=5.0, groups=[FULL, WINDOW], clock=lambda: now[0])
    tokens, hashes, _ = _request(seed, chunks)
    return events, feed, now, (tokens, hashes)


def test_a_hybrid_models_groups_are_announced_and_removed_each_on_its_own() -> None:
    """Two KV cache groups, each chunk an object of each (two key spaces): each group's blocks are announced once its
    objects are reported, tagged with the group, and removed with its own object, the other group's staying."""
    events, feed, _, (tokens, hashes) = _hybrid(5, 2)
    full, window = [os.urandom(32) for _ in range(2)], [os.urandom(32) for _ in range(2)]
    blocks = [tuple(hashes[:PER]), tuple(hashes[PER:])]
    events.finished("a", tokens, hashes)
    events.stores_done(["a"])
    feed.records.append(_stored(full, tokens, group=FULL))
    assert [(e.hashes, e.group) for e in events.take()] == [(blocks[0], 0), (blocks[1], 0)]  # the window's not yet
    feed.records.append(_stored(window, tokens, group=WINDOW))
    got = events.take()
    assert got == [
        BlocksStored(blocks[i], hashes[i * PER - 1] if i else None, tuple(tokens[i * CHUNK : (i + 1) * CHUNK]),
                     MEDIUM_CPU, LOCAL, 1)
        for i in range(2)
    ]  # fmt: skip
    feed.records.append(ChunksRemoved((window[0],), MEDIUM_CPU, LOCAL))  # demoted, then evicted: the window's only
    assert events.take() == [BlocksRemoved(blocks[0], MEDIUM_CPU, LOCAL, 1)]
    feed.records.append(ChunksRemoved((full[0],), MEDIUM_CPU, LOCAL))
    assert events.take() == [BlocksRemoved(blocks[0], MEDIUM_CPU, LOCAL, 0)]
    assert events.take() == []


def test_a_hybrid_store_announces_each_groups_chunks_held_when_it_is_reported() -> None:
    """The window group's first chunks left the pool before the worker reported the store (they are the first to go
    once a longer prefix supersedes them): its later chunk is announced, and every chunk of the full group."""
    events, feed, _, (tokens, hashes) = _hybrid(7, 3)
    full, window = [os.urandom(32) for _ in range(3)], [os.urandom(32) for _ in range(3)]
    feed.records += [_stored(full, tokens, group=FULL), _stored(window, tokens, group=WINDOW),
                     ChunksRemoved((window[0], window[1]), MEDIUM_CPU, LOCAL)]  # fmt: skip
    assert events.take() == []  # no store of them reported yet
    events.finished("a", tokens, hashes)
    events.stores_done(["a"])
    got = events.take()
    assert [(e.hashes, e.group) for e in got] == [
        *((tuple(hashes[i * PER : (i + 1) * PER]), 0) for i in range(3)),
        (tuple(hashes[2 * PER :]), 1),
    ]


def test_a_hybrid_group_s_chunk_never_stored_leaves_its_later_chunks_announced() -> None:
    """The window group's chunk 0 was never stored (its blocks were freed before the step that stored the chunk:
    it straddled two steps): its chunk 1, named by its whole prefix, is announced all the same."""
    events, feed, now, (tokens, hashes) = _hybrid(8, 2)
    full, window = [os.urandom(32) for _ in range(2)], [os.urandom(32) for _ in range(2)]
    later = _stored(window[1:], tokens, first=1, parent=window[0], group=WINDOW, prefix=_prefix(tokens, 1))
    feed.records += [_stored(full, tokens, group=FULL), later]
    events.finished("a", tokens, hashes)
    events.stores_done(["a"])
    assert [(e.hashes, e.group) for e in events.take()] == [
        (tuple(hashes[:PER]), 0), (tuple(hashes[PER:]), 0), (tuple(hashes[PER:]), 1)
    ]  # fmt: skip
    now[0] = 6.0
    assert events.take() == []  # chunk 0 of the window group is waited for no longer
    feed.records.append(_stored(window[:1], tokens, group=WINDOW))
    assert events.take() == []


def test_a_store_reported_after_its_chunks_moved_is_announced_where_they_are() -> None:
    """A busy pool spills a store's chunks to a tier (or drops them) before the worker reports the store done: its
    blocks are announced where they are then, and a chunk held nowhere ends the announcement."""
    events, feed, _ = _ledger()
    tokens, hashes, keys = _request(6, 3)
    events.finished("a", tokens, hashes)
    feed.records += [
        _stored(keys, tokens),
        ChunksStored((keys[0],), None, b"", MEDIUM_STORAGE, LOCAL),  # chunk 0 spilled to the disk tier
        ChunksRemoved((keys[0],), MEDIUM_CPU, LOCAL),
        ChunksRemoved((keys[2],), MEDIUM_CPU, LOCAL),  # chunk 2 dropped: held nowhere
    ]
    assert events.take() == []  # not reported done yet
    events.stores_done(["a"])
    got = events.take()
    blocks = [tuple(hashes[:PER]), tuple(hashes[PER : 2 * PER])]
    assert [(e.hashes, e.medium) for e in got] == [(blocks[0], MEDIUM_STORAGE), (blocks[1], MEDIUM_CPU)]  # at once
    feed.records.append(ChunksRemoved((keys[0],), MEDIUM_STORAGE, LOCAL))
    assert events.take() == [BlocksRemoved(tuple(hashes[:PER]), MEDIUM_STORAGE, LOCAL)]
