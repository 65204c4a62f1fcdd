"""The cache's KV events: every object entering and leaving the pool and a disk tier reported once, in order."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvferry.cache import CacheEngine
from kvferry.cache.event_queue import EventQueue
from kvferry.cache.events import MEDIUM_CPU, MEDIUM_STORAGE, AllCleared, ChunksRemoved, ChunksStored, Record
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.tiers import make_tier
from tests.cache.cachekit import CHUNK, NB, cache_engine, make_paged, random_blocks, random_tokens

FMT = F.NL_X_TWO_NB_BS_NH_HS


class Follower:
    """What a consumer knows from the records: keys per medium, and every removal (to count them)."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {MEDIUM_CPU: set(), MEDIUM_STORAGE: set()}
        self.removals: Counter[tuple[str, bytes]] = Counter()
        self.stored: list[ChunksStored] = []

    def apply(self, records: list[Record]) -> None:
        for record in records:
            if isinstance(record, AllCleared):
                for keys in self.held.values():
                    keys.clear()
            elif isinstance(record, ChunksStored):
                self.stored.append(record)
                self.held[record.medium].update(record.keys)
            else:
                assert isinstance(record, ChunksRemoved)
                for key in record.keys:
                    assert key in self.held[record.medium], "a removal of a key the stream never stored"
                    self.removals[record.medium, key] += 1
                self.held[record.medium].difference_update(record.keys)


def _drain(queue: EventQueue, follower: Follower) -> None:
    records, lost = queue.take()
    assert lost == 0
    follower.apply(records)


def _pool_keys(engine: CacheEngine) -> set[bytes]:
    return {e.key for e in engine._res.index if e.readable and not e.tail}


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def _engine(src: Any, objects: int, tiers: list[Any] | None = None) -> CacheEngine:
    return cache_engine(objects, FMT, src, tiers=tiers, watermark=1.0, eviction_batch=1)


def test_stores_and_evictions_are_reported_once_with_their_tokens() -> None:
    src = make_paged(FMT, NB, seed=1)
    queue, follower = EventQueue(10_000), Follower()
    with _engine(src, 6) as engine:
        engine.publish_events(queue)
        prompts = [random_tokens(3 * CHUNK + 5, seed) for seed in range(8)]
        for seed, tokens in enumerate(prompts):
            engine.store(tokens, src, random_blocks(6, seed), FMT)
            if seed % 3 == 0:
                engine.store(tokens, src, random_blocks(6, seed), FMT)  # present: nothing new to report
            _drain(queue, follower)
        assert follower.held[MEDIUM_CPU] == _pool_keys(engine)
        evictions = engine.stats()["evictions"]
    assert evictions == 8 * 3 - 6
    assert sum(follower.removals.values()) == evictions and set(follower.removals.values()) == {1}
    by_key = {key: tokens for tokens in prompts for key in engine.chunk_keys(tokens)}
    for record in follower.stored:  # a run of consecutive chunks: their tokens, after their parent
        ids = np.frombuffer(record.tokens, "<u4").tolist()
        assert len(ids) == CHUNK * len(record.keys)
        tokens = by_key[record.keys[-1]]
        keys = engine.chunk_keys(tokens)
        at = keys.index(record.keys[0])
        assert tuple(keys[at : at + len(record.keys)]) == record.keys
        assert ids == tokens[at * CHUNK : (at + len(record.keys)) * CHUNK]
        assert record.parent == (keys[at - 1] if at else None)


def test_a_tier_move_and_a_restart_with_a_disk_tier(tmp_path: Path) -> None:
    src = make_paged(FMT, NB, seed=2)
    url = f"disk:{tmp_path}/tier?size=24KiB"  # 6 objects of 4 KiB (and their headers): the disk evicts too
    queue, follower = EventQueue(10_000), Follower()
    disk = make_tier(url)
    with _engine(src, 4, [disk]) as engine:
        engine.publish_events(queue)
        for seed in range(6):
            engine.store(random_tokens(2 * CHUNK, seed), src, random_blocks(4, seed), FMT)
        _wait_for(lambda: engine.stats()["tier_writes"] == 8 and engine.stats()["objects"] == 4)
        _drain(queue, follower)
        assert disk._held is not None
        on_disk = set(disk._held.keys())
        assert follower.held[MEDIUM_CPU] == _pool_keys(engine)
        assert follower.held[MEDIUM_STORAGE] == on_disk and 0 < len(on_disk) < 8  # the disk evicted some
        moved = follower.held[MEDIUM_STORAGE] - follower.held[MEDIUM_CPU]
        assert moved and all(follower.removals[MEDIUM_CPU, key] == 1 for key in moved)
    assert set(follower.removals.values()) == {1}
    disk.close()
    disk = make_tier(url)  # a restart: the pool is empty, the disk keeps what it held
    restarted = EventQueue(10_000)
    with _engine(src, 4, [disk]) as engine:
        engine.publish_events(restarted)
        records, _ = restarted.take()
        assert isinstance(records[0], AllCleared)
        follower.apply(records)
        assert follower.held == {MEDIUM_CPU: set(), MEDIUM_STORAGE: on_disk}
    disk.close()


def test_a_full_queue_drops_counts_and_never_blocks_a_store() -> None:
    src = make_paged(FMT, NB, seed=3)
    queue, follower = EventQueue(3), Follower()
    with _engine(src, 6) as engine:
        source = engine.publish_events(queue)
        started = time.monotonic()
        for seed in range(10):
            engine.store(random_tokens(2 * CHUNK, seed), src, random_blocks(4, seed), FMT)
        assert time.monotonic() - started < 30  # nobody took a record: a blocking put would never return
        assert len(queue) == 3 and engine.stats()["events_dropped"] > 0
        records, lost = queue.take()
        assert lost > 0
        source.resync()  # what a publisher does on a loss: a marker, then everything held
        records, lost = queue.take()
        assert lost == 0 and isinstance(records[0], AllCleared)
        follower.apply(records)
        assert follower.held[MEDIUM_CPU] == _pool_keys(engine) and len(_pool_keys(engine)) == 6


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_queue_needs_room(capacity: int) -> None:
    with pytest.raises(ValueError):
        EventQueue(capacity)
