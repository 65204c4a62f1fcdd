"""A store whose copy is enqueued before its keys and index entries are made (`ChunkWriter._ahead`, the GPU
path's order), run on a CPU engine whose copy lands only when waited for (`cachekit.AheadCopies`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvferry.cache import CacheEngine
from kvferry.cache.writer import ChunkWriter
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.tiers import make_tier
from tests.cache.cachekit import (
    CHUNK,
    NB,
    PER_CHUNK,
    AheadCopies,
    assert_blocks_equal,
    cache_engine,
    make_paged,
    random_blocks,
    random_tokens,
)

FMT = F.NL_X_TWO_NB_BS_NH_HS


def _engine(objects: int = 16, fmt: F = FMT, **cache: Any) -> tuple[CacheEngine, Any]:
    src = make_paged(fmt, NB, seed=1)
    return cache_engine(objects, fmt, src, **cache), src


@pytest.fixture
def ahead(monkeypatch: pytest.MonkeyPatch) -> AheadCopies:
    return AheadCopies(monkeypatch)


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NB_NL_TWO_BS_NH_HS, F.NL_X_NB_BS_HS, F.NL_X_NB_NH_BS_TWO_HS])
def test_round_trip_bit_exact(ahead: AheadCopies, fmt: F) -> None:
    engine, src = _engine(fmt=fmt)
    dst = make_paged(fmt, NB, seed=2)
    tokens = random_tokens(3 * CHUNK + 5)
    ids, back = random_blocks(3 * PER_CHUNK + 1, 0), random_blocks(3 * PER_CHUNK, 1)
    with engine:
        assert engine.store(tokens, src, ids, fmt, skip_prefix_tokens=CHUNK) == 2 * CHUNK  # chunks 1 and 2
        assert (ahead.enqueued, ahead.waited) == (1, 1)
        assert engine.store(tokens, src, ids, fmt) == CHUNK  # chunk 0; 1 and 2 present: copied for nothing
        assert engine.stats()["present_chunks"] == 2 and engine.pool.num_allocations == 3  # spare objects freed
        assert engine.lookup(tokens) == 3 * CHUNK
        assert engine.retrieve(tokens, dst, back, fmt) == 3 * CHUNK
        assert_blocks_equal(src, ids[: 3 * PER_CHUNK], dst, back, fmt)


def test_a_store_that_copied_a_present_chunk_pauses_ahead(ahead: AheadCopies, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChunkWriter, "AHEAD_PAUSE", 2)
    engine, src = _engine()
    with engine:
        engine.store(random_tokens(CHUNK, 0), src, random_blocks(PER_CHUNK, 0), FMT)
        engine.store(random_tokens(CHUNK, 0), src, random_blocks(PER_CHUNK, 0), FMT)  # present: copied for nothing
        assert ahead.enqueued == 2
        for seed in (1, 2):  # the pause: in order (the CPU engine's own copy)
            assert engine.store(random_tokens(CHUNK, seed), src, random_blocks(PER_CHUNK, seed), FMT) == CHUNK
        assert ahead.enqueued == 2
        assert engine.store(random_tokens(CHUNK, 3), src, random_blocks(PER_CHUNK, 3), FMT) == CHUNK
        assert ahead.enqueued == 3 and engine.pool.num_allocations == 4


class TokensWhenRead(Sequence[int]):
    """Token ids made when first read, through numpy's array protocol (as SGLang's linker hands over its pages'
    tokens): logs how many copies had been enqueued by then."""

    def __init__(self, tokens: list[int], ahead: AheadCopies) -> None:
        self.tokens, self.ahead = tokens, ahead
        self.read_after: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        self.read_after.append(self.ahead.enqueued)
        return np.asarray(self.tokens, dtype=dtype or np.uint32)

    def __getitem__(self, index: Any) -> Any:
        return self.__array__()[index]


def test_tokens_made_when_read_are_read_once_the_copy_is_enqueued(ahead: AheadCopies) -> None:
    engine, src = _engine()
    dst = make_paged(FMT, NB, seed=2)
    tokens = random_tokens(2 * CHUNK)
    ids, back = random_blocks(2 * PER_CHUNK, 0), random_blocks(2 * PER_CHUNK, 1)
    when_read = TokensWhenRead(tokens, ahead)
    with engine:
        assert engine.store(when_read, src, ids, FMT) == 2 * CHUNK
        assert when_read.read_after == [1]  # read once, for the keys, after the copy was enqueued
        assert engine.retrieve(tokens, dst, back, FMT) == 2 * CHUNK  # the keys of the same ids as a list
        assert_blocks_equal(src, ids, dst, back, FMT)


def test_bad_tokens_found_after_the_copy_started_leave_nothing_behind(ahead: AheadCopies) -> None:
    engine, src = _engine()
    with engine:
        with pytest.raises((TypeError, ValueError)):
            engine.store([1] * (CHUNK - 1) + ["x"], src, random_blocks(PER_CHUNK, 0), FMT)  # type: ignore[list-item]
        assert (ahead.enqueued, ahead.waited) == (1, 1)  # the copy landed before its objects went back
        assert engine.pool.num_allocations == 0 and engine.stats()["objects"] == 0


def test_a_refused_copy_leaves_nothing_behind(ahead: AheadCopies) -> None:
    engine, src = _engine()
    with engine:
        with pytest.raises(ValueError, match="outside the pool"):
            engine.store(random_tokens(2 * CHUNK), src, [0, 1, 2, NB], FMT)
        assert ahead.enqueued == 0 and engine.pool.num_allocations == 0 and engine.stats()["objects"] == 0


def test_without_room_for_every_chunk_the_store_goes_in_order(ahead: AheadCopies) -> None:
    engine, src = _engine(objects=2, watermark=1.0)
    with engine:
        assert engine.store(random_tokens(3 * CHUNK), src, random_blocks(3 * PER_CHUNK, 0), FMT) == 2 * CHUNK
        assert ahead.enqueued == 0 and engine.stats()["skipped_chunks"] == 1


def test_a_store_into_a_full_pool_evicts_for_its_objects_and_still_copies_ahead(ahead: AheadCopies) -> None:
    # Room for 8 objects, kept at 6 or fewer once a store has landed: a 3-chunk store finds 2 free, so it evicts
    # before its copy is enqueued (in order, it would hash its keys and evict object by object first).
    engine, src = _engine(objects=8, watermark=0.75, eviction_batch=1)
    dst = make_paged(FMT, NB, seed=2)
    prompts = [random_tokens(3 * CHUNK, seed) for seed in range(5)]
    ids = [random_blocks(3 * PER_CHUNK, seed) for seed in range(5)]
    with engine:
        for prompt, blocks in zip(prompts, ids, strict=True):
            assert engine.store(prompt, src, blocks, FMT) == 3 * CHUNK
        assert (ahead.enqueued, ahead.waited) == (5, 5)
        stats = engine.stats()
        assert stats["evictions"] == 9 and stats["skipped_chunks"] == 0 and stats["objects"] == 6
        assert engine.lookup(prompts[-1]) == 3 * CHUNK and engine.lookup(prompts[0]) == 0
        back = random_blocks(3 * PER_CHUNK, 9)
        assert engine.retrieve(prompts[-1], dst, back, FMT) == 3 * CHUNK
        assert_blocks_equal(src, ids[-1], dst, back, FMT)


def test_a_store_whose_room_is_still_being_spilled_is_stored_whole(ahead: AheadCopies, tmp_path: Path) -> None:
    tier = make_tier(f"disk:{tmp_path}/tier?size=1MiB")
    src = make_paged(FMT, NB, seed=1)
    first, second = random_tokens(2 * CHUNK, 1), random_tokens(2 * CHUNK, 2)
    try:
        with cache_engine(2, FMT, src, tiers=[tier], watermark=1.0, eviction_batch=1) as engine:
            assert engine.store(first, src, random_blocks(2 * PER_CHUNK, 1), FMT) == 2 * CHUNK
            # `first` is evicted to the tier for room, its memory free only once written there: the store copies
            # ahead if that has happened by its reservation, else in order after waiting for it.
            assert engine.store(second, src, random_blocks(2 * PER_CHUNK, 3), FMT) == 2 * CHUNK
            assert engine.lookup(second) == 2 * CHUNK and engine.pool.num_allocations == 2
            assert engine.stats()["tier_writes"] == 2 and engine.stats()["skipped_chunks"] == 0
    finally:
        tier.close()
