"""Tensor-parallel ranks (each a slice of the model's heads) store and read whole objects: an object is readable
once every head's slice is written, and engines of any parallelism share it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from kvferry import describe
from kvferry.cache import CacheEngine
from kvferry.config import CacheConfig, KvferryConfig
from kvferry.formats import EngineKVFormat, layout_of
from tests.cache.cachekit import BS, CHUNK, NH, PER_CHUNK, assert_blocks_equal, make_paged

F = EngineKVFormat
FORMATS = [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS, F.TWO_X_NL_X_NBBS_NH_HS, F.NB_NL_TWO_BS_NH_HS]
NB = 12
TOKENS = list(range(1000, 1000 + 2 * CHUNK + 5))  # two full chunks and a partial one
IDS = [3, 7, 1, 10, 5]  # the engine blocks of TOKENS (ceil(len / BS) of them)


def rank_of(fmt: F, full: Any, first: int, count: int) -> Any:
    """The KV of a rank holding heads ``first .. first + count - 1`` of ``full``'s: each tensor narrowed, copied."""
    axis = layout_of(fmt).axes.index("NH")
    if isinstance(full, torch.Tensor):
        return full.narrow(axis, first, count).clone()
    return [rank_of(fmt, child, first, count) for child in full]


def poison(paged: Any) -> None:
    if isinstance(paged, torch.Tensor):
        paged.fill_(-3.5)
        return
    for child in paged:
        poison(child)


class Engine:
    """One engine (or one rank) of a deployment: its KV, geometry and key space in a shared cache."""

    def __init__(
        self, cache: CacheEngine, fmt: F, paged: Any, heads: tuple[int, int] | None, world_size: int = 1, rank: int = 0
    ) -> None:
        self.cache, self.fmt, self.paged = cache, fmt, paged
        self.geometry = describe(fmt, paged, BS, heads=heads)
        self.ns = cache.namespace_for("m", fmt, paged, world_size=world_size, rank=rank, geometry=self.geometry)

    def store(self) -> int:
        return self.cache.store(TOKENS, self.paged, IDS, self.fmt, namespace=self.ns, geometry=self.geometry)

    def retrieve(self) -> int:
        return self.cache.retrieve(TOKENS, self.paged, IDS, self.fmt, namespace=self.ns, geometry=self.geometry)

    def lookup(self) -> int:
        return self.cache.lookup(TOKENS, namespace=self.ns)


def make_cache(**cache: Any) -> CacheEngine:
    return CacheEngine(KvferryConfig(cache=CacheConfig(chunk_size=CHUNK, l1_size_gb=0.01, **cache)))


def ranks(cache: CacheEngine, fmt: F, full: Any) -> list[Engine]:
    half = NH // 2
    return [Engine(cache, fmt, rank_of(fmt, full, r * half, half), (r * half, NH), 2, r) for r in range(2)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_two_ranks_make_objects_a_whole_engine_reads(fmt: F) -> None:
    full = make_paged(fmt, NB, seed=1)
    with make_cache() as cache:
        r0, r1 = ranks(cache, fmt, full)
        assert r0.ns == r1.ns  # one key space: the objects hold every head
        assert r0.store() == 2 * CHUNK
        assert r0.lookup() == r1.lookup() == 0  # half an object is not a hit
        assert cache.stats()["pool_used_bytes"] > 0
        assert r1.store() == 2 * CHUNK
        assert r0.lookup() == r1.lookup() == 2 * CHUNK

        whole = Engine(cache, fmt, make_paged(fmt, NB, seed=9), None)
        assert whole.ns == r0.ns and whole.lookup() == 2 * CHUNK
        poison(whole.paged)
        assert whole.retrieve() == 2 * CHUNK
        n = 2 * PER_CHUNK
        assert_blocks_equal(full, IDS[:n], whole.paged, IDS[:n], fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_whole_engine_stores_and_each_rank_reads_its_heads(fmt: F) -> None:
    full = make_paged(fmt, NB, seed=2)
    with make_cache() as cache:
        whole = Engine(cache, fmt, full, None)
        assert whole.store() == 2 * CHUNK
        for r, rank in enumerate(ranks(cache, fmt, make_paged(fmt, NB, seed=5))):
            assert rank.lookup() == 2 * CHUNK
            poison(rank.paged)
            assert rank.retrieve() == 2 * CHUNK
            n = 2 * PER_CHUNK
            assert_blocks_equal(rank_of(fmt, full, r * NH // 2, NH // 2), IDS[:n], rank.paged, IDS[:n], fmt)


def test_a_rank_storing_again_before_the_other_neither_hits_nor_leaks() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    with make_cache() as cache:
        r0, r1 = ranks(cache, fmt, make_paged(fmt, NB, seed=3))
        assert r0.store() == 2 * CHUNK
        used = cache.pool.used_bytes
        assert r0.store() == 0  # its heads are taken: nothing to write, nothing new allocated
        assert cache.pool.used_bytes == used and r0.lookup() == 0
        assert r1.store() == 2 * CHUNK and r1.lookup() == 2 * CHUNK
        assert r1.store() == 0


def test_an_object_missing_a_rank_expires_and_frees_its_memory() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    with make_cache(slice_wait_s=0.05) as cache:
        r0, r1 = ranks(cache, fmt, make_paged(fmt, NB, seed=4))
        assert r0.store() == 2 * CHUNK
        assert cache.pool.used_bytes > 0
        time.sleep(0.1)
        assert r1.lookup() == 0  # lookups sweep expired slices
        stats = cache.stats()
        assert stats["expired_partial_chunks"] == 2 and stats["objects"] == 0 and cache.pool.used_bytes == 0
        assert r1.store() == 2 * CHUNK and r1.lookup() == 0  # a new object, waiting for rank 0 again
        assert r0.store() == 2 * CHUNK and r0.lookup() == 2 * CHUNK


def test_clear_while_slices_are_missing_frees_the_objects() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    with make_cache() as cache:
        r0, _ = ranks(cache, fmt, make_paged(fmt, NB, seed=6))
        assert r0.store() == 2 * CHUNK
        cache.clear()
        assert cache.pool.used_bytes == 0 and cache.stats()["objects"] == 0


def test_a_failed_slice_copy_drops_the_whole_object(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.cache import writer

    fmt = F.NL_X_TWO_NB_BS_NH_HS
    with make_cache() as cache:
        r0, r1 = ranks(cache, fmt, make_paged(fmt, NB, seed=7))
        assert r0.store() == 2 * CHUNK

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("copy failed")

        monkeypatch.setattr(writer, "copy_chunks", broken)
        with pytest.raises(RuntimeError, match="copy failed"):
            r1.store()
        monkeypatch.undo()
        assert r0.lookup() == 0 and cache.pool.used_bytes == 0 and cache.stats()["objects"] == 0
        assert r0.store() == 2 * CHUNK and r1.store() == 2 * CHUNK and r1.lookup() == 2 * CHUNK


def test_a_rank_of_a_model_without_a_head_axis_is_refused() -> None:
    fmt = F.NL_X_NB_BS_HS
    with pytest.raises(ValueError, match="no head axis"):
        describe(fmt, make_paged(fmt, NB), BS, heads=(0, 2))


def test_ranks_storing_concurrently_under_eviction_keep_every_hit_exact_and_free_everything() -> None:
    """Two rank threads store many prompts into a pool too small for them all, first in opposite orders, then the
    same prompts at the same time (as the ranks of one engine do); every hit a whole engine then reads holds the right
    bytes, the last prompts both stored are hits, and once cleared the pool holds nothing."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    full = make_paged(fmt, NB, seed=8)
    prompts = [[p * 7919 + t for t in range(2 * CHUNK)] for p in range(24)]
    object_bytes = 2 * 2 * CHUNK * NH * 8 * 2  # K/V x layers x tokens x heads x head size x bf16/fp16 bytes
    with CacheEngine(
        KvferryConfig(cache=CacheConfig(chunk_size=CHUNK, l1_size_gb=20 * object_bytes / 2**30, eviction_batch=2))
    ) as cache:
        r0, r1 = ranks(cache, fmt, full)
        errors: list[BaseException] = []
        # Steps in lockstep, so what the pool holds at the end does not depend on how the threads were scheduled.
        step = threading.Barrier(2)

        def run(rank: Engine, order: list[int]) -> None:
            try:
                for p in order:
                    step.wait(timeout=60)
                    rank.cache.store(prompts[p], rank.paged, IDS[: 2 * PER_CHUNK], fmt, namespace=rank.ns,
                                     geometry=rank.geometry)  # fmt: skip
            except BaseException as exc:
                errors.append(exc)
                step.abort()

        threads = [
            threading.Thread(target=run, args=(r0, list(range(24)))),
            threading.Thread(target=run, args=(r1, list(reversed(range(12))) + list(range(12, 24)))),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        whole = Engine(cache, fmt, make_paged(fmt, NB, seed=9), None)
        hits = []
        for prompt in prompts:
            poison(whole.paged)
            got = cache.retrieve(prompt, whole.paged, IDS[: 2 * PER_CHUNK], fmt, namespace=whole.ns,
                                 geometry=whole.geometry)  # fmt: skip
            n = got // BS
            assert_blocks_equal(full, IDS[:n], whole.paged, IDS[:n], fmt)
            hits.append(got)
        assert hits[-1] == 2 * CHUNK and sum(hits) < len(prompts) * 2 * CHUNK, hits
        stats = cache.stats()
        assert stats["locks"] == 0 and stats["evictions"] > 0, stats
        cache.clear()
        assert cache.pool.used_bytes == 0 and cache.stats()["objects"] == 0
