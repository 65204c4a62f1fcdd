"""`CacheEngine.written`: objects reserved in the pool, written by another copier (here `kvferry.transfer` into views
of them, as an engine's process writes its mapping of a shared pool), then adopted as a store's chunks and tail."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvferry
from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat as F
from kvferry.formats import describe
from kvferry.memory import HostPool
from tests.cache.cachekit import BS, NB, assert_blocks_equal, make_paged, random_blocks, random_tokens
from tests.cache.cachekit import OBJECT_BYTES as OBJECT_BYTES_OF_32

FMT = F.NL_X_TWO_NB_BS_NH_HS
CHUNK = 128  # 8 blocks: a tail of 3 leaves a whole 4 KiB unit of its reserved object to give back
OBJECT_BYTES = OBJECT_BYTES_OF_32 * CHUNK // 32
TAIL = 3 * BS


def engine_of(objects: int = 16, **cache: Any) -> CacheEngine:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, **cache}})
    engine = CacheEngine(config, pool=HostPool(objects * OBJECT_BYTES, pin=False, shared=True))
    engine.namespace = engine.namespace_for("test-model", FMT, make_paged(FMT, NB))
    return engine


def at(engine: CacheEngine, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An object of ``shape`` at the start of the reservation at ``offset``, as a copier's view of it."""
    slab = engine.pool.slab
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return slab[offset : offset + nbytes].view(dtype).view(shape)


def write(engine: CacheEngine, paged: Any, ids: list[int], addresses: list[int], tail: int, first: int = 0) -> None:
    """Copy chunks ``first..`` (and a tail of ``tail`` tokens into the last address) as an engine would."""
    geom = describe(FMT, paged)
    full = len(addresses) - (tail > 0)
    per_chunk = CHUNK // BS
    objects = [at(engine, a, geom.object_shape(CHUNK), geom.object_dtype) for a in addresses[:full]]
    chunk_ids = ids[first * per_chunk : (first + full) * per_chunk]
    kvferry.transfer(paged, objects, chunk_ids, kvferry.Direction.D2H, FMT, CHUNK)
    if tail:
        tail_obj = at(engine, addresses[-1], geom.object_shape(tail), geom.object_dtype)
        start = (first + full) * per_chunk
        kvferry.transfer(paged, [tail_obj], ids[start : start + tail // BS], kvferry.Direction.D2H, FMT, tail)


def test_adopted_chunks_and_tail_load_as_stored_ones_and_the_tails_spare_room_goes_back() -> None:
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    tokens = random_tokens(3 * CHUNK + TAIL + 5)
    src_ids, dst_ids = random_blocks(3 * CHUNK // BS + 3, seed=3), random_blocks(3 * CHUNK // BS + 3, seed=4)
    with engine_of() as engine:
        geom = describe(FMT, src)
        addresses = engine.written.reserve(geom, 4)
        assert len(addresses) == 4 and engine.pool.used_bytes == 4 * OBJECT_BYTES
        assert engine.lookup(tokens) == 0  # reserved is not indexed
        write(engine, src, src_ids, addresses, TAIL)
        stored = engine.written.adopt(tokens, engine.namespace, geom, 0, addresses[:3], (addresses[3], TAIL))
        assert stored == 3 * CHUNK + TAIL
        tail_bytes = OBJECT_BYTES * TAIL // CHUNK
        assert engine.pool.used_bytes == 3 * OBJECT_BYTES + -(-tail_bytes // 4096) * 4096
        assert engine.retrieve(tokens, dst, dst_ids, FMT, block_size=BS) == 3 * CHUNK + TAIL
        assert engine.stats()["stored_chunks"] == 4
    assert_blocks_equal(src, src_ids, dst, dst_ids, FMT)


def test_chunks_after_a_stored_prefix_and_a_present_chunk_freed() -> None:
    src, dst = make_paged(FMT, NB, seed=5), make_paged(FMT, NB, seed=6)
    tokens = random_tokens(3 * CHUNK, 9)
    ids, dst_ids = random_blocks(3 * CHUNK // BS, seed=7), random_blocks(3 * CHUNK // BS, seed=8)
    with engine_of() as engine:
        geom = describe(FMT, src)
        assert engine.store(tokens[: 2 * CHUNK], src, ids, FMT) == 2 * CHUNK
        used = engine.pool.used_bytes
        addresses = engine.written.reserve(geom, 2)  # chunk 1 (present) and chunk 2
        write(engine, src, ids, addresses, 0, first=1)
        assert engine.written.adopt(tokens, engine.namespace, geom, 1, addresses, None) == CHUNK
        assert engine.pool.used_bytes == used + OBJECT_BYTES  # the present chunk's copy went back
        assert engine.retrieve(tokens, dst, dst_ids, FMT) == 3 * CHUNK
    assert_blocks_equal(src, ids, dst, dst_ids, FMT)


def test_objects_that_do_not_match_the_tokens_are_refused_and_stay_the_callers() -> None:
    src = make_paged(FMT, NB, seed=1)
    tokens = random_tokens(2 * CHUNK + TAIL)
    with engine_of() as engine:
        geom = describe(FMT, src)
        addresses = engine.written.reserve(geom, 3)
        ns = engine.namespace
        with pytest.raises(ValueError, match="objects for chunks"):
            engine.written.adopt(tokens, ns, geom, 0, addresses[:1], None)
        with pytest.raises(ValueError, match="a tail of"):
            engine.written.adopt(tokens, ns, geom, 0, addresses[:2], (addresses[2], TAIL + 1))
        with pytest.raises(ValueError, match="a tail of"):
            engine.written.adopt(tokens[: 2 * CHUNK + BS], ns, geom, 0, addresses[:2], (addresses[2], TAIL))
        with pytest.raises(ValueError, match="no live allocation"):
            engine.written.adopt(tokens, ns, geom, 0, [addresses[0], addresses[0] + 4096], None)
        assert engine.lookup(tokens) == 0 and engine.pool.used_bytes == 3 * OBJECT_BYTES
        engine.written.give_back(addresses)
        assert engine.pool.used_bytes == 0


def test_a_reservation_evicts_for_room_and_is_refused_over_half_the_pool() -> None:
    src = make_paged(FMT, NB, seed=1)
    with engine_of(objects=8, watermark=1.0, eviction_batch=1) as engine:
        geom = describe(FMT, src)
        for seed in range(8):
            assert engine.store(random_tokens(CHUNK, 100 + seed), src, random_blocks(CHUNK // BS, seed), FMT) == CHUNK
        assert len(engine.written.reserve(geom, 4)) == 4  # the pool was full: four chunks evicted for them
        with pytest.raises(ValueError, match="over half the pool"):
            engine.written.reserve(geom, 5)
