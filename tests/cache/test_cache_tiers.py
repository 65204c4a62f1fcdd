"""The cache over storage tiers: write-behind on eviction, write-through on store, promotion, failing tiers."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from kvferry.cache import CacheEngine
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.tiers import Tier, make_tier
from tests.cache.cachekit import CHUNK, NB, assert_blocks_equal, cache_engine, make_paged, random_blocks, random_tokens

FMT = F.NL_X_TWO_NB_BS_NH_HS


def _engine(tiers: list[Any], objects: int, src: Any, **cache: Any) -> CacheEngine:
    return cache_engine(objects, FMT, src, tiers=tiers, **{"watermark": 1.0, "eviction_batch": 1, **cache})


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


@pytest.fixture
def disk(tmp_path: Path) -> Any:
    tier = make_tier(f"disk:{tmp_path}/tier?size=1MiB")
    yield tier
    tier.close()


def test_evicted_objects_spill_to_the_tier_and_come_back(disk: Tier) -> None:
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    first = random_tokens(2 * CHUNK, 1)
    src_ids, dst_ids = random_blocks(4, 1), random_blocks(4, 2)
    # Room for 6 objects, eviction above 4: the headroom holds objects while their tier writes run.
    with _engine([disk], 6, src, watermark=0.67) as engine:
        engine.store(first, src, src_ids, FMT)
        engine.store(random_tokens(2 * CHUNK, 2), src, random_blocks(4, 3), FMT)
        assert engine.store(random_tokens(2 * CHUNK, 3), src, random_blocks(4, 3), FMT) == 2 * CHUNK  # `first` spills
        _wait_for(lambda: engine.stats()["tier_writes"] == 2 and engine.stats()["objects"] == 4)
        status = engine.lookup_status(first)
        assert status.hit_tokens == 0 and status.pending_tokens == 2 * CHUNK  # in flight from the tier
        assert engine.prefetch(first).result(timeout=10) == 2 * CHUNK
        assert engine.retrieve(first, dst, dst_ids, FMT) == 2 * CHUNK
        stats = engine.stats()
    assert stats["promotions"] == 2 and stats["evictions"] >= 2 and stats["skipped_chunks"] == 0
    assert_blocks_equal(src, src_ids, dst, dst_ids, FMT)


def test_a_store_waits_for_spills_when_the_pool_is_full(disk: Tier) -> None:
    src = make_paged(FMT, NB, seed=1)
    first, second = random_tokens(2 * CHUNK, 1), random_tokens(2 * CHUNK, 2)
    with _engine([disk], 2, src) as engine:
        engine.store(first, src, random_blocks(4, 1), FMT)
        assert engine.store(second, src, random_blocks(4, 3), FMT) == 2 * CHUNK  # waited for `first` to spill
        assert engine.lookup(second) == 2 * CHUNK
        assert engine.stats()["tier_writes"] == 2


def test_write_through_lets_a_second_engine_read_the_tier(disk: Tier) -> None:
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    tokens = random_tokens(3 * CHUNK, 5)
    src_ids, dst_ids = random_blocks(6, 1), random_blocks(6, 2)
    with _engine([disk], 8, src, tier_write="on_store") as writer:
        writer.store(tokens, src, src_ids, FMT)
        _wait_for(lambda: writer.stats()["tier_writes"] == 3)
    with _engine([disk], 8, src) as reader:
        assert reader.lookup(tokens) == 0
        assert reader.prefetch(tokens).result(timeout=10) == 3 * CHUNK
        assert reader.retrieve(tokens, dst, dst_ids, FMT) == 3 * CHUNK
    assert_blocks_equal(src, src_ids, dst, dst_ids, FMT)


class _BrokenTier(Tier):
    """A tier whose backend refuses everything (as a tier that is down reports it: misses, never raises)."""

    def __init__(self) -> None:
        super().__init__("broken")

    capacity_bytes = None
    used_bytes = None

    def evict(self, nbytes: int) -> int:
        return 0

    def _submit_put(self, key: bytes, obj: Any, payload: memoryview) -> Future[bool]:
        done: Future[bool] = Future()
        done.set_result(False)
        return done

    def _submit_get(self, key: bytes, alloc: Any, free: Any) -> Future[Any]:
        done: Future[Any] = Future()
        done.set_result(None)
        return done

    def _contains(self, keys: list[bytes]) -> list[bool]:
        return [True] * len(keys)  # claims everything, delivers nothing: promotions must miss cleanly

    def _delete(self, key: bytes) -> None:
        pass


def test_a_failing_tier_gives_misses_and_drops_evicted_objects() -> None:
    src = make_paged(FMT, NB, seed=1)
    first = random_tokens(CHUNK, 1)
    with _engine([_BrokenTier()], 1, src) as engine:
        engine.store(first, src, random_blocks(2, 1), FMT)
        engine.store(random_tokens(CHUNK, 2), src, random_blocks(2, 2), FMT)
        _wait_for(lambda: engine.stats()["tier_write_failures"] == 1)
        assert engine.prefetch(first).result(timeout=10) == 0
        stats = engine.stats()
        assert stats["promotion_misses"] == 1 and stats["objects"] == 1
        assert engine.pool.num_allocations == 1
