"""The declarations and what is derived from them (shapes, validation)."""

from __future__ import annotations

import pytest
import torch

import kvferry
from kvferry.formats import LAYOUTS, EngineKVFormat, describe, layout_of
from kvferry.formats.synthetic import ModelDims, make_paged

F = EngineKVFormat
DIMS = ModelDims(nl=3, nh=2, hs=8, plane_widths=(8, 4))


def test_every_lmcache_id_is_declared_with_its_name() -> None:
    assert [f.value for f in F if f.value < 100] == list(range(19))
    assert F(18).name == "NL_X_NB_BS_NH_HS"
    assert F(3).name == "NL_X_NB_BS_HS"
    assert set(LAYOUTS) == set(F)


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        (F.NL_X_TWO_NB_BS_NH_HS, (2, 3, 16, 16)),  # MHA: [2, NL, chunk, NH*HS]
        (F.NB_NL_TWO_NH_BS_HS, (2, 3, 16, 16)),
        (F.NL_X_NB_BS_HS, (1, 3, 16, 8)),  # MLA: [1, NL, chunk, HS]
        (F.NL_X_NP_X_NB_BS_ONE_HS, (1, 3, 16, 12)),  # planes: widths add up
        (F.NL_X_NB_BS_NH_HS, (1, 3, 16, 16)),  # single plane
        (F.NL_X_NB_NH_BS_TWO_HS, (1, 3, 16, 32)),  # fused: NH*2*HS
        (F.NL_X_NB_BS_NH_CS, (1, 3, 16, 32)),
        (F.VLLM_CPU_NL_X_NB_NH_KT_V, (2, 3, 16, 16)),
    ],
)
def test_object_shape(fmt: F, shape: tuple[int, ...]) -> None:
    paged = make_paged(fmt, DIMS, num_blocks=5, block_size=4, dtype=torch.float16)
    assert kvferry.object_shape(fmt, paged, chunk_size=16, block_size=4) == shape


def test_derived_facts() -> None:
    assert layout_of(F.NL_X_NB_NH_BS_TWO_HS).fused and layout_of(F.NL_X_NB_NH_BS_TWO_HS).is_hnd
    assert not layout_of(F.NL_X_NB_TWO_NH_BS_HS).fused and layout_of(F.NL_X_NB_TWO_NH_BS_HS).kv_size == 2
    assert layout_of(F.NL_X_NB_BS_HS).is_mla and not layout_of(F.NL_X_NB_BS_NH_HS).is_mla
    assert layout_of(F.NB_NL_TWO_BS_NH_HS).is_cross_layer


def test_geometry_matches_seed_shape_desc() -> None:
    paged = make_paged(F.NL_X_NB_BS_HS, ModelDims(nl=4, nh=1, hs=576), 7, 64, block_padding=64)
    g = describe(F.NL_X_NB_BS_HS, paged)
    assert (g.kv_size, g.nl, g.nb, g.bs, g.nh, g.hs, g.element_size) == (1, 4, 7, 64, 1, 576, 2)
    assert g.block_stride_elems == paged[0].stride(0) == 64 * 576 + 64


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="not a known EngineKVFormat"):
        describe(77, [torch.zeros(1)])


def test_wrong_nesting_and_shapes() -> None:
    good = make_paged(F.NL_X_TWO_NB_BS_NH_HS, DIMS, 5, 4)
    with pytest.raises(TypeError, match="must be a non-empty list"):
        describe(F.NL_X_TWO_NB_BS_NH_HS, good[0])
    with pytest.raises(ValueError, match="must have 5 dims"):
        describe(F.NL_X_TWO_NB_BS_NH_HS, [t[0] for t in good])
    mixed = [good[0], good[1].to(torch.float32), good[2]]
    with pytest.raises(TypeError, match=r"paged\[1\] is torch.float32"):
        describe(F.NL_X_TWO_NB_BS_NH_HS, mixed)
    with pytest.raises(ValueError, match="shape"):
        describe(F.NL_X_TWO_NB_BS_NH_HS, [good[0], good[1][:, :3], good[2]])
    with pytest.raises(ValueError, match="axis TWO"):
        describe(F.NL_X_TWO_NB_BS_NH_HS, [torch.cat([t, t[:1]]) for t in good])
    with pytest.raises(ValueError, match="expanded"):
        describe(F.NL_X_NB_BS_HS, [torch.zeros(1, 4, 8).expand(5, 4, 8)])


def test_nbbs_needs_block_size() -> None:
    paged = make_paged(F.NL_X_NBBS_ONE_HS, DIMS, 5, 4)
    with pytest.raises(ValueError, match="pass block_size"):
        describe(F.NL_X_NBBS_ONE_HS, paged)
    with pytest.raises(ValueError, match="divide"):
        describe(F.NL_X_NBBS_ONE_HS, paged, block_size=3)
    assert describe(F.NL_X_NBBS_ONE_HS, paged, block_size=4).nb == 5


def test_indexer_cache_moves_bytes_only() -> None:
    paged = make_paged(F.NL_X_NB_BSV_BSS, ModelDims(nl=2, nh=1, hs=132), 3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="1-byte elements"):
        describe(F.NL_X_NB_BSV_BSS, paged)


def test_object_dtype_is_the_engines() -> None:
    paged = make_paged(F.NL_X_TWO_NB_BS_NH_HS, DIMS, 5, 4, dtype=torch.float16)
    assert kvferry.object_dtype(paged) == torch.float16
    with pytest.raises(TypeError, match=r"torch\.Tensors"):
        kvferry.object_dtype([[1, 2]])
