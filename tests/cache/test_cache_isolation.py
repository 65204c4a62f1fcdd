"""One caller's mistake costs the others nothing: refused requests touch no memory, a chunk that can never fit
evicts nothing, and a failed store does not take a concurrent store of the same prefix down with it."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.cache import CacheEngine, reader, writer
from kvferry.config import KvferryConfig
from kvferry.formats.kinds import EngineKVFormat as F
from tests.cache.cachekit import (
    BS,
    CHUNK,
    NB,
    assert_blocks_equal,
    cache_engine,
    make_paged,
    random_blocks,
    random_tokens,
)

FMT = F.NL_X_TWO_NB_BS_NH_HS
POOL_OBJECTS = 36


def _full_engine(src: Any, **cache: Any) -> CacheEngine:
    """An engine whose pool (36 objects of 4 KiB) is full of 36 cached one-chunk prompts."""
    engine = cache_engine(POOL_OBJECTS, FMT, src, **{"watermark": 1.0, **cache})
    for seed in range(POOL_OBJECTS):
        assert engine.store(random_tokens(CHUNK, 1000 + seed), src, random_blocks(2, seed), FMT) == CHUNK
    stats = engine.stats()
    assert (stats["objects"], stats["evictions"], stats["pool_free_bytes"]) == (POOL_OBJECTS, 0, 0)
    return engine


def _untouched(engine: CacheEngine) -> None:
    stats = engine.stats()
    assert (stats["objects"], stats["evictions"], stats["pool_used_bytes"]) == (POOL_OBJECTS, 0, POOL_OBJECTS * 4096)
    assert all(engine.lookup(random_tokens(CHUNK, 1000 + seed)) == CHUNK for seed in range(POOL_OBJECTS))


def test_a_store_refused_for_its_block_ids_evicts_nothing() -> None:
    src = make_paged(FMT, NB)
    with _full_engine(src) as engine:
        for seed in range(3):
            with pytest.raises(ValueError, match=rf"block_ids\[1\]={NB + 7} is outside the"):
                engine.store(random_tokens(2 * CHUNK, seed), src, [0, NB + 7, 2, 3], FMT)
        with pytest.raises(ValueError, match=r"block_ids\[3\]=-1 is outside the"):
            engine.store(random_tokens(2 * CHUNK, 5), src, np.array([0, 1, 2, -1]), FMT)
        with pytest.raises(TypeError, match="block_ids must hold integers"):
            engine.store(random_tokens(2 * CHUNK, 6), src, torch.tensor([0.0, 1.0, 2.0, 3.0]), FMT)
        _untouched(engine)
        assert engine.stats()["skipped_chunks"] == 0


@pytest.mark.parametrize("checked_by", ["cache", "copy"])
def test_every_request_checks_its_block_ids_whether_or_not_it_copies(
    checked_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``copy``: a retrieve leaves the check of its ids to the copy (`PendingBlockIds`, as on a GPU engine, whose
    first DMAs into staging then go first): the same refusals, hit or miss, and a refused hit lets its chunks go."""
    if checked_by == "copy":
        monkeypatch.setattr(reader, "copies_in_background", lambda geom, pool: True)
    src = make_paged(FMT, NB)
    cached = random_tokens(2 * CHUNK, 7)
    with _full_engine(src) as engine:
        engine.clear()
        engine.store(cached, src, random_blocks(4, 1), FMT)
        out_of_range = [NB, NB + 1, NB + 2, NB + 3]
        with pytest.raises(ValueError, match="is outside the"):  # cached already: nothing to copy
            engine.store(cached, src, out_of_range, FMT)
        with pytest.raises(ValueError, match="is outside the"):  # a miss: nothing to copy
            engine.retrieve(random_tokens(2 * CHUNK, 8), src, out_of_range, FMT)
        with pytest.raises(ValueError, match="repeats a block"):
            engine.retrieve(random_tokens(2 * CHUNK, 8), src, [1, 2, 3, 1], FMT)
        with pytest.raises(ValueError, match="is outside the"):  # a hit
            engine.retrieve(cached, src, out_of_range, FMT)
        with pytest.raises(ValueError, match="repeats a block"):
            engine.retrieve(cached, src, [1, 2, 3, 1], FMT)
        assert engine.retrieve(cached, src, random_blocks(4, 3), FMT) == 2 * CHUNK
        # Blocks before the copy's first one (a retrieve's skipped prefix) are the engine's own business.
        assert engine.retrieve(cached, src, [NB + 9, 5, 6, 7], FMT, skip_prefix_tokens=BS) == 2 * CHUNK - BS
        assert engine.stats()["retrieves"] == 2 and engine.stats()["stores"] == POOL_OBJECTS + 1  # refused: uncounted
        engine.clear()  # a refused hit held no chunk: every object's memory goes back
        assert engine.stats()["pool_used_bytes"] == 0


def test_tokens_and_block_ids_of_the_wrong_kind_are_named() -> None:
    src = make_paged(FMT, NB)
    with _full_engine(src) as engine:
        with pytest.raises(TypeError, match=r"tokens must be a sequence of token ids .* got NoneType"):
            engine.store(None, src, [0, 1], FMT)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="tokens must be a sequence of token ids"):
            engine.retrieve(None, src, [0, 1], FMT)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"block_ids must be a sequence of ints.* got NoneType"):
            engine.store(random_tokens(CHUNK), src, None, FMT)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="block_ids must be a sequence of ints"):
            engine.store(random_tokens(CHUNK), src, [0, 1.5], FMT)
        _untouched(engine)


def test_a_chunk_larger_than_the_whole_pool_is_skipped_without_evicting() -> None:
    src = make_paged(FMT, NB)
    # 2 layers of [2, NB, BS, 2 heads, 1024]: a 32-token chunk object is 512 KiB, the pool 144 KiB.
    huge = [torch.zeros(2, 8, BS, 2, 1024, dtype=torch.float16) for _ in range(2)]
    with _full_engine(src) as engine:
        namespace = engine.namespace_for("huge-model", FMT, huge)
        assert engine.store(random_tokens(2 * CHUNK, 9), huge, [0, 1, 2, 3], FMT, namespace=namespace) == 0
        assert engine.stats()["skipped_chunks"] == 2
        _untouched(engine)


def test_the_pool_size_must_fit_the_machine() -> None:
    config = KvferryConfig.load(env={}, overrides={"cache": {"l1_size_gb": 1 << 20}})
    with pytest.raises(ValueError, match=r"cache.l1_size_gb=1048576.0 .* exceeds this machine's memory"):
        CacheEngine(config)


class _HeldCopy:
    """Patches the cache's copy so that the first store's copy is held until released, then fails (or not)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fail: bool) -> None:
        self.copying = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        original = writer.copy_chunks

        def copy_chunks(*args: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                self.copying.set()
                assert self.release.wait(10)
                if fail:
                    raise RuntimeError("the first store's copy failed")
            return original(*args)

        monkeypatch.setattr(writer, "copy_chunks", copy_chunks)


def _concurrent_stores(engine: CacheEngine, src: Any, tokens: list[int], ids: list[int], held: _HeldCopy) -> list:
    """The results of two stores of one prefix, the second started while the first copies, and the prefix hit
    the second store's caller sees right after it returns."""
    results: dict[str, Any] = {}

    def store(name: str, n_tokens: int) -> None:
        try:
            results[name] = engine.store(tokens[:n_tokens], src, ids, FMT)
        except Exception as exc:
            results[name] = exc
        results[f"{name} then sees"] = engine.lookup(tokens)

    first = threading.Thread(target=store, args=("first", 2 * CHUNK))
    first.start()
    assert held.copying.wait(10)
    second = threading.Thread(target=store, args=("second", 3 * CHUNK))  # the same prefix and one chunk more
    second.start()
    second.join(0.3)  # it has reserved its third chunk and found the first two in flight
    held.release.set()
    first.join(10)
    second.join(10)
    return [results["first"], results["second"], results["second then sees"]]


def test_a_store_takes_over_the_chunks_of_a_concurrent_store_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    tokens, ids = random_tokens(3 * CHUNK, 3), random_blocks(6, 3)
    with _full_engine(src) as engine:
        engine.clear()
        held = _HeldCopy(monkeypatch, fail=True)
        first, second, seen = _concurrent_stores(engine, src, tokens, ids, held)
        assert isinstance(first, RuntimeError)
        assert second == 3 * CHUNK  # its own third chunk, and the two the first store left behind
        assert seen == engine.lookup(tokens) == 3 * CHUNK
        assert engine.retrieve(tokens, dst, random_blocks(6, 4), FMT) == 3 * CHUNK
        assert engine.pool.used_bytes == 3 * 4096
    assert_blocks_equal(src, ids, dst, random_blocks(6, 4), FMT)


def test_a_store_waits_for_the_chunks_a_concurrent_store_is_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_paged(FMT, NB, seed=1)
    tokens, ids = random_tokens(3 * CHUNK, 5), random_blocks(6, 5)
    with _full_engine(src) as engine:
        engine.clear()
        held = _HeldCopy(monkeypatch, fail=False)
        # The second store returns once the whole prefix is readable, not while the first still copies it.
        assert _concurrent_stores(engine, src, tokens, ids, held) == [2 * CHUNK, CHUNK, 3 * CHUNK]
        assert held.calls == 2 and engine.lookup(tokens) == 3 * CHUNK
        assert engine.pool.used_bytes == 3 * 4096


def test_a_copy_that_ends_after_the_callers_deadline_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller stops waiting at ``valid_until`` and may reuse its blocks: bytes copied later are suspect."""
    src = make_paged(FMT, NB)
    tokens = random_tokens(2 * CHUNK, 11)
    with _full_engine(src) as engine:
        engine.clear()
        original = writer.copy_chunks

        def slow_copy(*args: Any) -> Any:
            time.sleep(0.3)
            return original(*args)

        monkeypatch.setattr(writer, "copy_chunks", slow_copy)
        assert engine.store(tokens, src, random_blocks(4, 1), FMT, valid_until=time.time() + 0.1) == 0
        stats = engine.stats()
        assert (stats["late_chunks"], stats["objects"], stats["pool_used_bytes"]) == (2, 0, 0)
        assert engine.store(tokens, src, random_blocks(4, 1), FMT, valid_until=time.time() + 10) == 2 * CHUNK
        assert engine.lookup(tokens) == 2 * CHUNK
