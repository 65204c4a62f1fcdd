"""The object codec in the cache: its own key space, half the pool bytes, a refusal that says why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import describe
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.memory import HostPool

FMT, NB, BS, CHUNK = F.NL_X_TWO_NB_BS_NH_HS, 32, 16, 32
DIMS = ModelDims(nl=2, nh=2, hs=64)


def _paged(seed: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return make_paged(FMT, DIMS, NB, BS, dtype, generator=torch.Generator().manual_seed(seed))


def _cache(codec: str = "fp8") -> CacheEngine:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "codec": codec}})
    return CacheEngine(config, pool=HostPool(4 << 20, pin=False))


def test_fp8_engine_and_exact_engine_share_a_cache_apart() -> None:
    src, dst = _paged(1), _paged(2)
    tokens = np.random.default_rng(0).integers(0, 32_000, size=4 * CHUNK).tolist()
    ids = list(range(8))
    with _cache() as cache:
        fp8 = cache.namespace_for("m", FMT, src)
        exact = cache.namespace_for("m", FMT, src, codec="none")
        assert fp8.codec == "fp8" and fp8.digest != exact.digest
        assert cache.store(tokens, src, ids, FMT, namespace=fp8) == 4 * CHUNK
        fp8_bytes = cache.stats()["stored_bytes"]
        assert cache.lookup(tokens, namespace=exact) == 0  # an exact engine never gets fp8 objects
        assert cache.store(tokens, src, ids, FMT, namespace=exact) == 4 * CHUNK
        exact_bytes = cache.stats()["stored_bytes"] - fp8_bytes
        assert 1.8 * fp8_bytes < exact_bytes < 2 * fp8_bytes  # half the bytes, but for the scales (64 per 4 bytes)
        assert cache.lookup(tokens, namespace=fp8) == cache.lookup(tokens, namespace=exact) == 4 * CHUNK
        assert cache.retrieve(tokens, dst, list(range(8, 16)), FMT, namespace=fp8) == 4 * CHUNK
    plain = describe(FMT, src)
    for layer_src, layer_dst in zip(src, dst, strict=True):
        a, b = layer_src[:, :8].float(), layer_dst[:, 8:16].float()
        groups = a.unflatten(-1, (-1, 64)) if a.shape[-1] == 64 * plain.nh else a
        amax = groups.abs().amax(-1, keepdim=True)
        assert bool(((b - a).abs() <= amax * (2**-4 + 2**-8)).all())
        assert not torch.equal(a, b)  # lossy: the round trip is not the identity


@pytest.mark.parametrize(("dtype", "why"), [(torch.float32, "bf16 and fp16"), (torch.uint8, "fp8 already")])
def test_a_dtype_the_codec_cannot_take_is_refused_at_registration(dtype: torch.dtype, why: str) -> None:
    with _cache() as cache, pytest.raises(ValueError, match=why):
        cache.namespace_for("m", FMT, _paged(1, dtype))


def test_a_full_pool_holds_nearly_twice_the_tokens_with_fp8() -> None:
    """The same pool, filled by prompts until it evicts: `cached_tokens` with fp8 over without (1056 / 2048 bytes
    per row for llama3-8b; 136 / 256 for these 2 x 64 heads, so 1.88x here)."""
    held = {}
    paged = make_paged(FMT, DIMS, 256, BS, torch.bfloat16, generator=torch.Generator().manual_seed(3))
    for codec in ("none", "fp8"):
        config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": 256, "codec": codec}})
        with CacheEngine(config, pool=HostPool(4 << 20, pin=False)) as cache:
            cache.namespace = cache.namespace_for("m", FMT, paged)
            for prompt in range(40):
                tokens = np.random.default_rng(prompt).integers(0, 32_000, size=256).tolist()
                cache.store(tokens, paged, list(range(16 * (prompt % 16), 16 * (prompt % 16) + 16)), FMT)
            held[codec] = cache.stats()["cached_tokens"]
    assert held["fp8"] >= 1.85 * held["none"] > 0
