"""Layers kept exact beside the fp8 codec: their bytes round-trip bit for bit, the others within the codec's
bound, and the split's key spaces share nothing with the model's unsplit ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.cache import CacheEngine, LayerSplitKV
from kvferry.config import KvferryConfig
from kvferry.formats import layer_split, select_layers
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.memory import HostPool

NB, BS, CHUNK = 24, 16, 32
DIMS = ModelDims(nl=5, nh=2, hs=64)
BOUND = 2**-4 + 2**-8  # of a group's largest magnitude (docs/codec.md)


def _paged(fmt: F, seed: int, device: str = "cpu") -> object:
    paged = make_paged(fmt, DIMS, NB, BS, torch.bfloat16, generator=torch.Generator().manual_seed(seed))
    return paged.to(device) if isinstance(paged, torch.Tensor) else [t.to(device) for t in paged]


def _cache(device: str = "cpu", **cache: object) -> CacheEngine:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, **cache}})
    return CacheEngine(config, pool=HostPool(8 << 20, pin=device == "cuda"))  # a GPU engine's objects: pinned


def _rows(fmt: F, paged: object, layer: int, ids: list[int]) -> torch.Tensor:
    """Layer ``layer``'s KV in blocks ``ids``: a row of head vectors (groups of HS values) per block."""
    if fmt == F.NB_NL_TWO_BS_NH_HS:
        return paged[ids, layer].reshape(len(ids), -1).cpu()  # type: ignore[index]
    return paged[layer][:, ids].transpose(0, 1).reshape(len(ids), -1).cpu()  # type: ignore[index]


ON_GPU = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", ON_GPU])  # the torch backend; the Triton kernels
@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NB_NL_TWO_BS_NH_HS])  # a layer list; layers in a tensor
def test_exact_layers_round_trip_bit_exact_and_the_others_within_the_bound(fmt: F, device: str) -> None:
    src, dst = _paged(fmt, 1, device), _paged(fmt, 2, device)
    tokens = np.random.default_rng(0).integers(0, 32_000, size=3 * CHUNK + 5).tolist()
    src_ids, dst_ids = [3, 9, 1, 14, 7, 20], [2, 17, 8, 23, 12, 4]
    with _cache(device, codec="fp8", exact_layers=[0, -1]) as cache:
        kv = LayerSplitKV(cache, "m", fmt, src)
        assert [(p.part.layers, p.namespace.codec) for p in kv.parts] == [((0, 4), "none"), ((1, 2, 3), "fp8")]
        assert kv.store(tokens, src_ids) == 3 * CHUNK
        assert kv.lookup(tokens) == 3 * CHUNK
        reader = LayerSplitKV(cache, "m", fmt, dst)
        before = _rows(fmt, dst, 0, dst_ids[:1])
        assert reader.retrieve(tokens, dst_ids, skip_prefix_tokens=CHUNK // 2) == 3 * CHUNK - CHUNK // 2
    assert torch.equal(_rows(fmt, dst, 0, dst_ids[:1]), before)  # the engine's half chunk: never written
    for layer in range(DIMS.nl):
        got, want = _rows(fmt, dst, layer, dst_ids[1:]), _rows(fmt, src, layer, src_ids[1:])
        if layer in (0, DIMS.nl - 1):
            assert torch.equal(got, want)  # exact layers: the engine's bytes
        else:
            groups = want.float().unflatten(-1, (-1, DIMS.hs))
            err = (got.float().unflatten(-1, (-1, DIMS.hs)) - groups).abs()
            assert bool((err <= groups.abs().amax(-1, keepdim=True) * BOUND).all()) and not torch.equal(got, want)


def test_the_split_key_spaces_share_nothing_with_the_models_plain_ones() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = _paged(fmt, 1)
    tokens = np.random.default_rng(1).integers(0, 32_000, size=2 * CHUNK).tolist()
    ids = list(range(4))
    with _cache(codec="fp8") as cache:
        first_last = LayerSplitKV(cache, "m", fmt, src, exact_layers=[0, -1])
        first = LayerSplitKV(cache, "m", fmt, src, exact_layers=[0])
        last = LayerSplitKV(cache, "m", fmt, src, exact_layers=[4])
        plain = [cache.namespace_for("m", fmt, src, codec=codec) for codec in ("none", "fp8")]
        digests = [ns.digest for kv in (first_last, first, last) for ns in (p.namespace for p in kv.parts)]
        assert len(set(digests + [ns.digest for ns in plain])) == len(digests) + 2
        assert first_last.store(tokens, ids) == 2 * CHUNK
        assert [cache.lookup(tokens, namespace=ns) for ns in plain] == [0, 0]
        assert first.lookup(tokens) == last.lookup(tokens) == 0
        assert cache.store(tokens, src, ids, fmt, namespace=plain[1]) == 2 * CHUNK
        assert first.lookup(tokens) == 0  # the plain fp8 objects hold layer 0 in fp8: never an exact part's
        assert LayerSplitKV(cache, "m", fmt, src, exact_layers=[0, 4]).lookup(tokens) == 2 * CHUNK  # 4 is -1
    with _cache() as cache:  # codec none: exact layers change nothing, the plain exact key space
        kv = LayerSplitKV(cache, "m", fmt, src, exact_layers=[0, -1])
        assert [p.namespace for p in kv.parts] == [cache.namespace_for("m", fmt, src)]


def test_a_hit_is_the_prefix_every_part_holds() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = _paged(fmt, 1)
    tokens = np.random.default_rng(2).integers(0, 32_000, size=3 * CHUNK).tolist()
    with _cache(codec="fp8", exact_layers=[2]) as cache:
        kv = LayerSplitKV(cache, "m", fmt, src)
        exact, coded = kv.parts
        cache.store(tokens, exact.paged, list(range(6)), fmt, namespace=exact.namespace, geometry=exact.geometry)
        cache.store(tokens[: 2 * CHUNK], coded.paged, list(range(4)), fmt, namespace=coded.namespace)
        assert kv.lookup(tokens) == 2 * CHUNK


def test_layer_splits_and_their_refusals() -> None:
    assert [p.layers for p in layer_split(4, "fp8", [-1, 0, 0]).parts] == [(0, 3), (1, 2)]
    assert layer_split(4, "fp8", [0, 1, 2, 3]).parts[0].codec == "none"  # every layer exact: an exact engine
    assert layer_split(4, "fp8").tag == layer_split(4, "none", [0]).tag == ""
    with pytest.raises(ValueError, match=r"\[4\] are not layers"):
        layer_split(4, "fp8", [0, 4])
    in_tensors = _paged(F.NB_NL_TWO_BS_NH_HS, 3)
    first_last = select_layers(F.NB_NL_TWO_BS_NH_HS, in_tensors, [0, 4])
    assert first_last.data_ptr() == in_tensors.data_ptr() and first_last.shape[1] == 2  # a view, no copy
    with pytest.raises(ValueError, match="not evenly spaced"):
        select_layers(F.NB_NL_TWO_BS_NH_HS, in_tensors, [0, 1, 4])
    with _cache(codec="fp8", exact_layers=[1]) as cache, pytest.raises(ValueError, match="fp8 already"):
        LayerSplitKV(cache, "m", F.NL_X_TWO_NB_BS_NH_HS, make_paged(F.NL_X_TWO_NB_BS_NH_HS, DIMS, NB, BS, torch.uint8))
    assert KvferryConfig.load(env={"KVFERRY_CACHE__EXACT_LAYERS": "0,-1"}).cache.exact_layers == [0, -1]
