"""The cache on a GPU engine: its objects move through the GPU data path (`transfer_pool_async`, and a store's by
address first: `transfer_pool_at_async`).

Run on a CUDA machine: `.ci/gpu-tests 4 tests/cache/test_cache_gpu.py`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvferry import Direction, transfer
from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import ModelDims, make_paged, random_fill
from tests.conftest import leaves

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CHUNK, BS = 64, 16


@pytest.mark.parametrize("fmt", [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, EngineKVFormat.NL_X_NB_BS_HS])
def test_store_then_retrieve_into_other_blocks_is_bit_exact(fmt: EngineKVFormat) -> None:
    dims = ModelDims(nl=4, nh=2, hs=64) if fmt != EngineKVFormat.NL_X_NB_BS_HS else ModelDims(nl=4, nh=1, hs=576)
    paged = make_paged(fmt, dims, 64, BS, device="cuda")
    for tensor in leaves(paged):
        random_fill(tensor)
    geom = describe(fmt, paged)
    with CacheEngine(KvferryConfig.load(overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.0625}})) as cache:
        ns = cache.namespace_for("m", fmt, paged, geometry=geom)
        tokens = list(range(1000, 1000 + 3 * CHUNK + 5))  # three chunks and a tail
        source = torch.randperm(64)[:13].tolist()
        assert cache.store(tokens[:CHUNK], paged, source, fmt, namespace=ns, geometry=geom) == CHUNK  # one chunk
        # The rest: the GPU path copies before it looks, so chunk 0 is copied again and its object given back.
        assert cache.store(tokens, paged, source, fmt, namespace=ns, geometry=geom) == 2 * CHUNK
        assert cache.stats()["present_chunks"] == 1 and cache.pool.num_allocations == 3
        with pytest.raises(ValueError, match="outside the pool of 64 blocks"):
            cache.store(list(range(5000, 5000 + CHUNK)), paged, [0, 1, 2, 64], fmt, namespace=ns, geometry=geom)
        assert cache.lookup(list(range(5000, 5000 + CHUNK)), namespace=ns) == 0  # nothing half-stored
        assert cache.pool.num_allocations == 3
        target = [b for b in range(64) if b not in source][:13]
        assert cache.retrieve(tokens, paged, target, fmt, namespace=ns, geometry=geom) == 3 * CHUNK
        torch.cuda.synchronize()
        # What the target blocks hold now, read by the plain reference copy: the source blocks' KV.
        shape = geom.object_shape(CHUNK)
        read = [[torch.empty(shape, dtype=geom.dtype, device="cuda") for _ in range(3)] for _ in range(2)]
        for objs, ids in zip(read, (source, target), strict=True):
            transfer(paged, objs, ids[:12], Direction.D2H, fmt, CHUNK, backend="reference", geometry=geom)
        assert all(torch.equal(a, b) for a, b in zip(*read, strict=True))


def test_a_prompt_shorter_than_a_chunk_loads_its_tail_and_pages_load_in_one_retrieve() -> None:
    """A GPU retrieve starts its first DMA from the first chunk's key: a prompt with no full chunk has none (its tail
    is all it holds), and a retrieve of pages finds each page's key alone."""
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, ModelDims(nl=4, nh=2, hs=64), 64, BS, device="cuda")
    for tensor in leaves(paged):
        random_fill(tensor)
    geom = describe(fmt, paged)
    with CacheEngine(KvferryConfig.load(overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.0625}})) as cache:
        ns = cache.namespace_for("m", fmt, paged, geometry=geom)
        short = list(range(7000, 7000 + 2 * BS + 3))  # two blocks of tail, no full chunk
        assert cache.store(short, paged, [5, 6, 7], fmt, namespace=ns, geometry=geom, tail=True) == 2 * BS
        assert cache.retrieve(short, paged, [40, 41, 42], fmt, namespace=ns, geometry=geom) == 2 * BS
        pages = [list(range(8000 + i * CHUNK, 8000 + (i + 1) * CHUNK)) for i in range(3)]
        per = CHUNK // BS
        for i, page in enumerate(pages):
            assert cache.store(page, paged, list(range(8 + i * per, 8 + (i + 1) * per)), fmt, namespace=ns) == CHUNK
        target = list(range(44, 44 + 3 * per))
        tokens = [t for page in pages for t in page]
        assert cache.retrieve(tokens, paged, target, fmt, namespace=ns, geometry=geom, pages=True) == 3 * CHUNK
        torch.cuda.synchronize()
        for layer in paged:
            assert torch.equal(layer[:, [40, 41]], layer[:, [5, 6]])
            assert torch.equal(layer[:, target], layer[:, list(range(8, 8 + 3 * per))])


def test_stores_into_a_full_pinned_pool_evict_first_and_still_copy_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight objects of room, kept at six once a store has landed: every 3-chunk store after the second finds two
    free and evicts before its copy, which is still enqueued before its keys (`ChunkWriter._ahead`)."""
    from kvferry.cache import writer

    enqueued = []
    enqueue = writer.transfer_pool_at_async

    def counted(*args: Any) -> Any:
        enqueued.append(args)
        return enqueue(*args)

    monkeypatch.setattr(writer, "transfer_pool_at_async", counted)
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, ModelDims(nl=4, nh=2, hs=64), 64, BS, device="cuda")
    for tensor in leaves(paged):
        random_fill(tensor)
    geom = describe(fmt, paged)
    room = 8 * geom.bytes_per_token * CHUNK / 2**30
    cache_config = {"chunk_size": CHUNK, "l1_size_gb": room, "watermark": 0.75, "eviction_batch": 1}
    with CacheEngine(KvferryConfig.load(overrides={"cache": cache_config})) as cache:
        assert cache.pool.is_pinned
        ns = cache.namespace_for("m", fmt, paged, geometry=geom)
        prompts = [list(range(1000 * i, 1000 * i + 3 * CHUNK)) for i in range(1, 5)]
        per = 3 * CHUNK // BS
        for i, tokens in enumerate(prompts):
            assert cache.store(tokens, paged, list(range(i * per, (i + 1) * per)), fmt, namespace=ns) == 3 * CHUNK
        assert len(enqueued) == 4
        stats = cache.stats()
        assert stats["evictions"] == 6 and stats["skipped_chunks"] == 0 and stats["objects"] == 6
        assert cache.lookup(prompts[0], namespace=ns) == 0
        target = list(range(4 * per, 5 * per))
        assert cache.retrieve(prompts[-1], paged, target, fmt, namespace=ns, geometry=geom) == 3 * CHUNK
        torch.cuda.synchronize()
        for layer in paged:
            assert torch.equal(layer[:, target], layer[:, list(range(3 * per, 4 * per))])
