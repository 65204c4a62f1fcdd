"""`CacheEngine.locate`: a prefix's objects in a shared pool, read by another mapping of it as an engine's process
would, under a read lease that keeps their bytes until it ends."""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

import pytest
import torch

import kvferry
from kvferry.cache import CacheEngine
from kvferry.cache.lookup import Located
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat as F
from kvferry.formats import describe
from kvferry.memory import HostPool
from tests.cache.cachekit import (
    BS,
    CHUNK,
    NB,
    OBJECT_BYTES,
    assert_blocks_equal,
    make_paged,
    random_blocks,
    random_tokens,
)

FMT = F.NL_X_TWO_NB_BS_NH_HS


def shared_engine(objects: int = 16, **cache: Any) -> CacheEngine:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, **cache}})
    engine = CacheEngine(config, pool=HostPool(objects * OBJECT_BYTES, pin=False, shared=True))
    engine.namespace = engine.namespace_for("test-model", FMT, make_paged(FMT, NB))
    return engine


def mapped_views(engine: CacheEngine, located: Located, paged: Any) -> list[torch.Tensor]:
    """The located objects as views of a second mapping of the pool's memfd (another process's, as it maps it)."""
    fd = engine.pool.shared_fd
    assert fd is not None
    opened = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR)
    try:
        whole = torch.frombuffer(mmap.mmap(opened, engine.pool.capacity_bytes), dtype=torch.uint8)
    finally:
        os.close(opened)
    geom = describe(FMT, paged)
    views = []
    for offset, tokens in located.objects:
        shape = geom.object_shape(tokens)
        nbytes = torch.Size(shape).numel() * geom.object_dtype.itemsize
        views.append(whole[offset : offset + nbytes].view(geom.object_dtype).view(shape))
    return views


def test_located_objects_read_through_another_mapping_equal_what_was_stored() -> None:
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    tokens = random_tokens(3 * CHUNK + 40)
    src_ids, dst_ids = random_blocks(8, seed=3), random_blocks(8, seed=4)
    with shared_engine() as engine:
        assert engine.store(tokens, src, src_ids, FMT, tail=True) == 3 * CHUNK + 32
        located = engine.locate(tokens, block_size=BS)
        assert located.tokens == 3 * CHUNK + 32 and located.lease is not None
        assert [n for _, n in located.objects] == [CHUNK, CHUNK, CHUNK, 32]  # the tail last
        assert located.deadline > time.monotonic()
        kvferry.transfer(dst, mapped_views(engine, located, dst), dst_ids, kvferry.Direction.H2D, FMT, CHUNK)
        assert engine.stats()["read_leases"] == 1 and engine.stats()["located_chunks"] == 4
        assert engine.free_lookup_locks(located.lease)
        assert engine.stats()["read_leases"] == 0
    assert_blocks_equal(src, src_ids, dst, dst_ids, FMT)


def test_a_read_lease_keeps_its_objects_bytes_through_a_clear_and_a_full_pool() -> None:
    src = make_paged(FMT, NB, seed=1)
    tokens = random_tokens(2 * CHUNK, 7)
    with shared_engine(objects=4, watermark=1.0, eviction_batch=1) as engine:
        engine.store(tokens, src, random_blocks(4, 0), FMT)
        located = engine.locate(tokens)
        assert located.lease is not None
        views = mapped_views(engine, located, src)
        before = [view.clone() for view in views]
        engine.clear()
        assert engine.lookup(tokens) == 0
        for seed in range(6):  # the pool's two other objects, over and over: the leased memory is not reused
            engine.store(random_tokens(CHUNK, 100 + seed), make_paged(FMT, NB, seed=seed), random_blocks(2, 0), FMT)
        assert all(torch.equal(view, old) for view, old in zip(views, before, strict=True))
        assert engine.pool.num_allocations == 4
        assert engine.free_lookup_locks(located.lease)
        assert engine.pool.num_allocations == 2  # the cleared objects went back once the lease ended


def test_a_read_lease_ends_at_its_deadline() -> None:
    src = make_paged(FMT, NB)
    tokens = random_tokens(CHUNK, 3)
    with shared_engine(lock_timeout_s=0.2) as engine:
        engine.store(tokens, src, random_blocks(2, 0), FMT)
        located = engine.locate(tokens)
        assert located.deadline <= time.monotonic() + 0.2
        time.sleep(0.3)
        assert engine.lookup(tokens) == CHUNK  # a lookup ends what is due
        stats = engine.stats()
        assert (stats["read_leases"], stats["lock_timeouts"]) == (0, 1)
        assert located.lease is not None and not engine.free_lookup_locks(located.lease)


def test_a_miss_locates_nothing_and_checksummed_objects_are_not_located() -> None:
    with shared_engine() as engine:
        assert engine.locate(random_tokens(2 * CHUNK)) == Located(0, None, 0.0, [])
        assert engine.stats()["read_leases"] == 0
    with shared_engine(verify_checksums=True) as engine, pytest.raises(ValueError, match="verify_checksums"):
        engine.locate(random_tokens(CHUNK))
