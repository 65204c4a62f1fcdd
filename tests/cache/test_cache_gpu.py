"""The cache on a GPU engine: its objects move through the GPU data path (`transfer_pool_async`, and a store's by
address first: `transfer_pool_at_async`).

Run on a CUDA machine: `.ci/gpu-tests 4 tests/cache/test_cache_gpu.py`.
"""

from __future__ import annotations

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
