"""CacheEngine: store -> lookup -> retrieve round trips, prefix semantics, eviction, locks, errors, metrics."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from kvferry.cache import CacheEngine, CacheNamespace, writer
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.memory import HostPool
from tests.cache.cachekit import (
    BS,
    CHUNK,
    NB,
    assert_blocks_equal,
    block_contents,
    cache_engine,
    make_paged,
    random_blocks,
    random_tokens,
)

ROUND_TRIP_FORMATS = [
    F.NL_X_TWO_NB_BS_NH_HS,
    F.NB_NL_TWO_BS_NH_HS,
    F.NL_X_NB_TWO_BS_NH_HS,
    F.TWO_X_NL_X_NBBS_NH_HS,
    F.NL_X_TWO_NB_NH_BS_HS,
    F.NL_X_NB_BS_NH_CS,
    F.NL_X_TWO_X_NB_BS_NH_HS,
    F.NL_X_NB_BS_NH_HS,
]


@pytest.mark.parametrize("fmt", ROUND_TRIP_FORMATS, ids=lambda f: f.name)
def test_store_lookup_retrieve_into_other_blocks_is_bit_exact(fmt: F) -> None:
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(5 * CHUNK + 7)
    src_ids, dst_ids = random_blocks(11, seed=3), random_blocks(11, seed=4)
    before_tail = block_contents(dst, fmt, dst_ids[10]).clone()
    block_size = BS if fmt == F.TWO_X_NL_X_NBBS_NH_HS else None
    with cache_engine(fmt=fmt, paged=src, block_size=block_size) as engine:
        assert engine.lookup(tokens) == 0
        assert engine.store(tokens, src, src_ids, fmt, block_size=block_size) == 5 * CHUNK
        assert engine.lookup(tokens) == 5 * CHUNK
        assert engine.retrieve(tokens, dst, dst_ids, fmt, block_size=block_size) == 5 * CHUNK
    assert_blocks_equal(src, src_ids[:10], dst, dst_ids[:10], fmt)
    assert torch.equal(block_contents(dst, fmt, dst_ids[10]), before_tail)  # the tail is never written


def test_prefix_semantics_a_diverging_token_in_chunk_k_hits_k_chunks() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    tokens = random_tokens(6 * CHUNK)
    with cache_engine(paged=src) as engine:
        engine.store(tokens, src, random_blocks(12, 0), fmt)
        for k in range(6):
            other = list(tokens)
            other[k * CHUNK + 5] += 1
            assert engine.lookup(other) == k * CHUNK
        assert engine.lookup(tokens[: 3 * CHUNK + 1]) == 3 * CHUNK


def test_a_lookup_from_a_chunk_on_needs_only_the_chunks_from_there() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    tokens = random_tokens(6 * CHUNK)
    with cache_engine(paged=src) as engine:
        engine.store(tokens, src, random_blocks(12, 0), fmt)
        with engine._res.lock:  # chunk 1 goes: a lookup from chunk 0 stops there, one from chunk 2 does not
            engine._res.detach_locked(engine._res.index.get(engine.chunk_keys(tokens)[1]))
        assert engine.lookup_status(tokens).hit_tokens == CHUNK
        found = engine.lookup_status(tokens, lock=True, first_chunk=2)
        assert found.hit_tokens == 6 * CHUNK and found.lock_id is not None
        engine.free_lookup_locks(found.lock_id)
        assert engine.lookup_status(tokens, first_chunk=1).hit_tokens == CHUNK  # its first chunk is missing
        assert engine.lookup_status(tokens, first_chunk=9).hit_tokens == 6 * CHUNK  # past the prompt: nothing asked


def test_demoted_chunks_are_evicted_first_and_a_read_moves_them_back() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    first, second = random_tokens(4 * CHUNK, seed=1), random_tokens(4 * CHUNK, seed=2)
    with cache_engine(objects=8, paged=src, eviction_batch=1, watermark=1.0) as engine:  # room for 8 chunks
        engine.store(first, src, random_blocks(8, 0), fmt)
        engine.store(second, src, random_blocks(8, 1), fmt)  # the least recent now: the first prompt's chunks
        engine.demote(second, range(2, 4))
        engine.demote(first, range(0, 0))  # nothing
        engine.store(random_tokens(2 * CHUNK, seed=3), src, random_blocks(4, 2), fmt)  # room for 2 more: the demoted go
        assert engine.lookup(first) == 4 * CHUNK and engine.lookup(second) == 2 * CHUNK
        engine.demote(first, range(4))
        engine.retrieve(first[: 2 * CHUNK], make_paged(fmt, NB), random_blocks(4, 3), fmt)  # read: back at the end
        engine.store(random_tokens(2 * CHUNK, seed=4), src, random_blocks(4, 4), fmt)
        assert engine.lookup(first) == 2 * CHUNK


def test_store_copies_only_missing_chunks() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(5 * CHUNK)
    src_ids, dst_ids = random_blocks(10, 5), random_blocks(10, 6)
    with cache_engine(paged=src) as engine:
        assert engine.store(tokens[:CHUNK], src, src_ids, fmt) == CHUNK
        assert engine.store(tokens, src, src_ids, fmt) == 4 * CHUNK
        assert engine.store(tokens, src, src_ids, fmt) == 0
        stats = engine.stats()
        assert (stats["present_chunks"], stats["stored_chunks"], stats["stores"]) == (1 + 5, 5, 3)
        assert engine.retrieve(tokens, dst, dst_ids, fmt) == 5 * CHUNK
    assert_blocks_equal(src, src_ids, dst, dst_ids, fmt)


def test_store_fills_holes_with_one_gathered_transfer() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(5 * CHUNK)
    src_ids, dst_ids = random_blocks(10, 5), random_blocks(10, 6)
    with cache_engine(objects=5, paged=src, watermark=1.0, eviction_batch=1) as engine:
        engine.store(tokens, src, src_ids, fmt)
        # Recency order after these: chunk 1, chunk 3 oldest.
        engine.retrieve(tokens[:CHUNK], dst, dst_ids, fmt)
        engine.retrieve(tokens[: 3 * CHUNK], dst, dst_ids, fmt, skip_prefix_tokens=2 * CHUNK)
        engine.retrieve(tokens, dst, dst_ids, fmt, skip_prefix_tokens=4 * CHUNK)
        engine.store(random_tokens(2 * CHUNK, 9), src, random_blocks(4, 9), fmt)  # evicts chunks 1 and 3
        assert engine.lookup(tokens) == CHUNK
        engine.clear()  # room for the refill; the index must not keep chunks 0, 2 and 4 either
        engine.store(tokens[:CHUNK], src, src_ids, fmt)
        engine.store(tokens[: 3 * CHUNK], src, src_ids, fmt, skip_prefix_tokens=2 * CHUNK)
        engine.store(tokens, src, src_ids, fmt, skip_prefix_tokens=4 * CHUNK)
        assert engine.lookup(tokens) == CHUNK  # chunks 0, 2, 4 present: holes at 1 and 3
        assert engine.store(tokens, src, src_ids, fmt) == 2 * CHUNK  # blocks of chunks 1 and 3, gathered
        assert engine.retrieve(tokens, dst, dst_ids, fmt) == 5 * CHUNK
    assert_blocks_equal(src, src_ids, dst, dst_ids, fmt)


def test_block_ids_as_tensor_and_gathered() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(3 * CHUNK)
    src_ids, dst_ids = random_blocks(6, 1), random_blocks(6, 2)
    with cache_engine(paged=src) as engine:
        engine.store(tokens, src, torch.tensor(src_ids), fmt, skip_prefix_tokens=CHUNK)
        engine.store(tokens[:CHUNK], src, np.array(src_ids), fmt)
        assert engine.retrieve(tokens, dst, torch.tensor(dst_ids), fmt) == 3 * CHUNK
    assert_blocks_equal(src, src_ids, dst, dst_ids, fmt)


def test_retrieve_skip_prefix_leaves_the_engines_blocks_alone() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(4 * CHUNK)
    src_ids, dst_ids = random_blocks(8, 1), random_blocks(8, 2)
    untouched = [block_contents(dst, fmt, b).clone() for b in dst_ids[:3]]
    skip = CHUNK + BS + 3  # one full chunk and one block of the next are the engine's own
    with cache_engine(paged=src) as engine:
        engine.store(tokens, src, src_ids, fmt)
        assert engine.retrieve(tokens, dst, dst_ids, fmt, skip_prefix_tokens=skip) == 4 * CHUNK - skip
        assert engine.retrieve(tokens, dst, dst_ids, fmt, skip_prefix_tokens=4 * CHUNK) == 0
    for block, before in zip(dst_ids[:3], untouched, strict=True):
        assert torch.equal(block_contents(dst, fmt, block), before)
    assert_blocks_equal(src, src_ids[3:], dst, dst_ids[3:], fmt)


def test_retrieve_miss_and_partial_hit() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(4 * CHUNK)
    with cache_engine(paged=src) as engine:
        assert engine.retrieve(tokens, dst, random_blocks(8, 2), fmt) == 0
        engine.store(tokens[: 2 * CHUNK], src, random_blocks(4, 1), fmt)
        assert engine.retrieve(tokens, dst, random_blocks(8, 2), fmt) == 2 * CHUNK
        stats = engine.stats()
    assert stats["retrieves"] == 2 and stats["retrieved_chunks"] == 2


def test_bad_arguments_raise_clearly_and_leak_nothing() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    tokens = random_tokens(2 * CHUNK)
    with cache_engine(paged=src) as engine:
        with pytest.raises(ValueError, match="block_ids has 3 entries"):
            engine.store(tokens, src, [1, 2, 3], fmt)
        with pytest.raises(ValueError, match="skip_prefix_tokens"):
            engine.retrieve(tokens, src, random_blocks(4, 0), fmt, skip_prefix_tokens=-1)
        with pytest.raises(ValueError, match="skip_prefix_tokens=65 exceeds"):
            engine.store(tokens, src, random_blocks(4, 0), fmt, skip_prefix_tokens=65)
        with pytest.raises(ValueError, match="namespace"):
            engine.store(tokens, make_paged(F.NL_X_NB_BS_NH_CS, NB), random_blocks(4, 0), F.NL_X_NB_BS_NH_CS)
        with pytest.raises(ValueError, match="namespace"):
            engine.lookup(tokens, namespace="model")  # type: ignore[arg-type]
        with pytest.raises(Exception, match="block"):  # the transfer rejects a block id outside the pool
            engine.store(tokens, src, [0, 1, 2, NB + 5], fmt)
        assert engine.stats()["objects"] == 0
        assert engine.pool.used_bytes == 0
        assert engine.lookup(tokens) == 0
    with pytest.raises(ValueError, match="namespace"):
        CacheEngine(pool=HostPool(4096, pin=False)).lookup(tokens)


def test_namespaces_separate_models_in_one_engine() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    tokens = random_tokens(2 * CHUNK)
    with cache_engine(paged=src) as engine:
        other = CacheNamespace("other-model", engine.namespace.kv_dtype, engine.namespace.layout)
        engine.store(tokens, src, random_blocks(4, 0), fmt)
        assert engine.lookup(tokens, namespace=other) == 0
        engine.store(tokens, src, random_blocks(4, 0), fmt, namespace=other)
        assert engine.lookup(tokens, namespace=other) == 2 * CHUNK
        assert engine.stats()["objects"] == 4


@pytest.mark.parametrize(("policy", "evicted"), [("lru", 0), ("s3fifo", 1)])
def test_eviction_order_follows_the_policy(policy: str, evicted: int) -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    prompts = [random_tokens(CHUNK, seed) for seed in range(5)]
    with cache_engine(objects=4, paged=src, eviction_policy=policy, watermark=1.0, eviction_batch=1) as engine:
        for p in prompts[:4]:
            engine.store(p, src, random_blocks(2, 0), fmt)
        for i in (0, 0, 0, 1, 2, 3):
            engine.retrieve(prompts[i], dst, random_blocks(2, 1), fmt)
        engine.store(prompts[4], src, random_blocks(2, 0), fmt)
        gone = [i for i, p in enumerate(prompts) if engine.lookup(p) == 0]
    # LRU drops prompt 0, the least recently used. S3-FIFO counts uses: 0 was used three times, the others
    # once, so its CLOCK pass over the main queue takes 1, the oldest key left without uses.
    assert gone == [evicted]


def test_watermark_evicts_a_batch() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    with cache_engine(objects=24, paged=src, watermark=0.5, eviction_batch=3) as engine:
        for seed in range(12):
            engine.store(random_tokens(CHUNK, seed), src, random_blocks(2, 0), fmt)
        assert engine.stats()["evictions"] == 0
        engine.store(random_tokens(CHUNK, 12), src, random_blocks(2, 0), fmt)  # would cross 50%: a batch of 3 goes
        stats = engine.stats()
    assert stats["evictions"] == 3 and stats["objects"] == 10
    assert [engine.lookup(random_tokens(CHUNK, s)) for s in range(13)] == [0] * 3 + [CHUNK] * 10


def test_one_eviction_takes_no_more_than_a_quarter_of_a_small_pool() -> None:
    """The default batch (16) in a pool of 6 objects: one eviction takes one object, the oldest, not all of them
    with the object just stored."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    with cache_engine(objects=6, paged=src, watermark=1.0) as engine:
        for seed in range(7):
            engine.store(random_tokens(CHUNK, seed), src, random_blocks(2, 0), fmt)
        stats = engine.stats()
        hits = [engine.lookup(random_tokens(CHUNK, s)) for s in range(7)]
    assert stats["evictions"] == 1 and stats["objects"] == 6
    assert hits == [0] + [CHUNK] * 6


def test_a_store_evicts_while_its_copy_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store takes its objects from the room above the watermark and evicts back under it after its copy has
    been started (the eviction then overlaps the copy), never with its own objects as victims."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    with cache_engine(objects=24, paged=src, watermark=0.5, eviction_batch=3) as engine:
        for seed in range(12):
            engine.store(random_tokens(CHUNK, seed), src, random_blocks(2, 0), fmt)
        copy = writer.copy_chunks
        seen: list[tuple[int, int]] = []

        def copy_chunks(*args: Any) -> Any:
            seen.append((engine.stats()["evictions"], engine.pool.num_allocations))
            return copy(*args)

        monkeypatch.setattr(writer, "copy_chunks", copy_chunks)
        engine.store(random_tokens(CHUNK, 12), src, random_blocks(2, 0), fmt)
        assert seen == [(0, 13)]  # the copy starts with 13 of 24 objects held: above the 50% watermark
        assert (engine.stats()["evictions"], engine.pool.num_allocations) == (3, 10)
        assert engine.lookup(random_tokens(CHUNK, 12)) == CHUNK


def test_a_locked_object_is_never_evicted_until_unlocked() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    precious = random_tokens(2 * CHUNK, 100)
    with cache_engine(objects=4, paged=src, watermark=1.0, eviction_batch=1) as engine:
        engine.store(precious, src, random_blocks(4, 0), fmt)
        result = engine.lookup_status(precious, lock=True)
        assert result.hit_tokens == 2 * CHUNK and result.lock_id is not None
        for seed in range(10):
            engine.store(random_tokens(CHUNK, seed), src, random_blocks(2, 0), fmt)
            assert engine.lookup(precious) == 2 * CHUNK
        assert engine.stats()["locks"] == 1 and engine.stats()["pinned_objects"] == 2
        assert engine.retrieve(precious, dst, random_blocks(4, 1), fmt, lock_id=result.lock_id) == 2 * CHUNK
        assert engine.stats()["locks"] == 0
        assert not engine.free_lookup_locks(result.lock_id)
        assert engine.store(random_tokens(4 * CHUNK, 50), src, random_blocks(8, 0), fmt) == 4 * CHUNK  # fills the pool
        assert engine.lookup(precious) == 0


def test_lookup_locks_freed_together_unpin_what_each_held() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    prompts = [random_tokens(CHUNK, seed) for seed in range(3)]
    with cache_engine(paged=src) as engine:
        for prompt in prompts:
            engine.store(prompt, src, random_blocks(2, 0), fmt)
        locks = [engine.lookup_status(prompt, lock=True).lock_id for prompt in prompts]
        assert None not in locks and engine.stats()["pinned_objects"] == 3
        assert engine.free_lookup_locks(locks[0])
        assert engine.free_lookup_locks_many([locks[0], locks[1], locks[2], 12345]) == 2  # one freed, one unknown
        assert engine.stats()["locks"] == 0 and engine.stats()["pinned_objects"] == 0
        assert engine.free_lookup_locks_many([]) == 0


def test_a_lookup_lock_times_out() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    precious = random_tokens(CHUNK, 100)
    with cache_engine(objects=2, paged=src, watermark=1.0, eviction_batch=1, lock_timeout_s=0.2) as engine:
        engine.store(precious, src, random_blocks(2, 0), fmt)
        lock_id = engine.lookup_status(precious, lock=True).lock_id
        assert lock_id is not None
        engine.store(random_tokens(CHUNK, 1), src, random_blocks(2, 0), fmt)
        engine.store(random_tokens(CHUNK, 2), src, random_blocks(2, 0), fmt)
        assert engine.lookup(precious) == CHUNK  # still locked
        time.sleep(0.3)
        engine.store(random_tokens(CHUNK, 3), src, random_blocks(2, 0), fmt)
        assert engine.lookup(precious) == 0
        stats = engine.stats()
        assert stats["lock_timeouts"] == 1 and stats["locks"] == 0
        assert not engine.free_lookup_locks(lock_id)


def test_full_pool_of_locked_objects_makes_store_skip_not_raise() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    held = random_tokens(3 * CHUNK, 1)
    with cache_engine(objects=3, paged=src) as engine:
        engine.store(held, src, random_blocks(6, 0), fmt)
        engine.lookup_status(held, lock=True)
        assert engine.store(random_tokens(2 * CHUNK, 2), src, random_blocks(4, 0), fmt) == 0
        stats = engine.stats()
        assert stats["skipped_chunks"] == 2 and stats["objects"] == 3
        assert engine.lookup(held) == 3 * CHUNK


def test_clear_drops_everything() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    tokens = random_tokens(3 * CHUNK)
    with cache_engine(paged=src) as engine:
        engine.store(tokens, src, random_blocks(6, 0), fmt)
        engine.lookup_status(tokens, lock=True)
        engine.clear()
        assert engine.lookup(tokens) == 0
        stats = engine.stats()
        assert (stats["objects"], stats["locks"], stats["pool_used_bytes"]) == (0, 0, 0)


def test_async_store_and_retrieve() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(4 * CHUNK)
    src_ids, dst_ids = random_blocks(8, 1), random_blocks(8, 2)
    with cache_engine(paged=src) as engine:
        assert engine.store_async(tokens, src, src_ids, fmt).result(timeout=30) == 4 * CHUNK
        assert engine.retrieve_async(tokens, dst, dst_ids, fmt).result(timeout=30) == 4 * CHUNK
        failed = engine.store_async(tokens, src, [1], fmt)
        with pytest.raises(ValueError, match="block_ids"):
            failed.result(timeout=30)
    assert_blocks_equal(src, src_ids, dst, dst_ids, fmt)


def test_corrupt_object_is_a_miss_when_checksums_are_on() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(3 * CHUNK)
    with cache_engine(paged=src, verify_checksums=True) as engine:
        engine.store(tokens, src, random_blocks(6, 1), fmt)
        second = engine._res.index.get(engine.chunk_keys(tokens)[1])
        assert second is not None and second.obj is not None
        second.obj.view(-1)[7] += 1  # a stray write into the pool
        assert engine.retrieve(tokens, dst, random_blocks(6, 2), fmt) == CHUNK
        stats = engine.stats()
        assert stats["checksum_failures"] == 1 and stats["objects"] == 2
        assert engine.lookup(tokens) == CHUNK


def test_metrics_per_engine_registry() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB)
    tokens = random_tokens(2 * CHUNK + 5)
    with cache_engine(paged=src) as first, cache_engine(paged=src) as second:
        first.store(tokens, src, random_blocks(5, 0), fmt)
        first.lookup(tokens)
        second.lookup(tokens)
        text = generate_latest(first.metrics_registry).decode()
        assert 'kvferry_cache_hit_tokens_total{engine="cache"} 64.0' in text
        assert 'kvferry_cache_miss_tokens_total{engine="cache"} 5.0' in text
        assert 'kvferry_cache_stored_bytes_total{engine="cache"} 8192.0' in text
        assert 'kvferry_cache_pool_used_bytes{engine="cache"} 8192.0' in text
        other = generate_latest(second.metrics_registry).decode()
        assert 'kvferry_cache_hit_tokens_total{engine="cache"} 0.0' in other
        stats = first.stats()
        assert stats["store_gbps"] > 0 and stats["pool"]["num_allocations"] == 2
