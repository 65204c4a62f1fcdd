"""Page DMA's copies (`kvferry.kernels.page_dma`), carried out on the CPU with memmove, against the reference
backend: any layout that has a page plan, odd sizes, a partial last object, any skip, both directions, pages of
consecutive blocks merged. Which layouts have one, and that the others do not, is checked too."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe, layout_of, with_codec
from kvferry.formats.synthetic import ModelDims, make_paged, random_fill
from kvferry.kernels.page_dma import page_copies, page_plan
from tests.conftest import dims_for, engine_bytes, kv_dtype_for, poisoned, tile_scale

F = EngineKVFormat


def _dims(fmt: EngineKVFormat, nl: int, nh: int, hs: int, planes: tuple[int, ...] = (3, 5)) -> ModelDims:
    """Plane widths for the plane-split MLA layouts, the usual dimensions for the others."""
    return ModelDims(nl, nh, hs, planes) if "NP" in layout_of(fmt).nesting else dims_for(fmt, ModelDims(nl, nh, hs))


def _has_page_plan(fmt: EngineKVFormat) -> bool:
    bs = 4 * tile_scale(fmt, 4)
    paged = make_paged(fmt, _dims(fmt, 2, 2, 4), 3, bs, kv_dtype_for(fmt, torch.bfloat16))
    return page_plan(describe(fmt, paged, block_size=bs)) is not None


FORMATS = [f for f in F if _has_page_plan(f)]


def test_token_major_layouts_have_a_page_plan_and_head_major_ones_none() -> None:
    assert F.NL_X_TWO_NB_BS_NH_HS in FORMATS  # vLLM FlashAttention, a tensor per layer
    assert F.NL_X_NB_BS_HS in FORMATS  # FlashMLA
    head_major = [f for f in F if "NH_BS" in f.name]
    assert head_major and not set(head_major) & set(FORMATS)


def test_a_compressed_or_partial_geometry_has_no_page_plan() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, ModelDims(2, 2, 16), 4, 16)
    assert page_plan(describe(fmt, paged, block_size=16)) is not None
    assert page_plan(with_codec(describe(fmt, paged, block_size=16), "fp8")) is None
    partial = describe(fmt, paged, block_size=16, heads=(0, 4))
    assert page_plan(partial) is None


def _run(dev: np.ndarray, host: np.ndarray, sizes: np.ndarray, to_objects: bool) -> None:
    for d, h, n in zip(dev.tolist(), host.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(h, d, n) if to_objects else ctypes.memmove(d, h, n)


@st.composite
def requests(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    fmt = draw(st.sampled_from(FORMATS))
    planes = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    dims = _dims(fmt, draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 9)), planes)
    bs = draw(st.integers(1, 5))
    per_object = draw(st.integers(1, 3))
    n_objects = draw(st.integers(1, 3))
    last_blocks = draw(st.integers(1, per_object))
    n_ids = (n_objects - 1) * per_object + last_blocks
    nb = n_ids + draw(st.integers(0, 4))
    ids = draw(st.one_of(st.permutations(list(range(nb))), st.just(list(range(nb)))))[:n_ids]  # runs merge
    skip = draw(st.integers(0, n_ids))
    dtype = kv_dtype_for(fmt, draw(st.sampled_from([torch.bfloat16, torch.float32, torch.uint8])))
    return fmt, dims, bs, per_object * bs, n_objects, last_blocks * bs, nb, ids, skip, dtype


@settings(max_examples=80, deadline=None)
@given(requests(), st.integers(0, 2**31), st.booleans())
def test_page_copies_move_what_the_reference_moves(req, seed: int, one_buffer: bool) -> None:  # type: ignore[no-untyped-def]
    fmt, dims, bs, chunk, n_objects, last_tokens, nb, ids, skip, dtype = req
    gen = torch.Generator().manual_seed(seed)
    paged = make_paged(fmt, dims, nb, bs, dtype, one_buffer=one_buffer, generator=gen)
    geom = describe(fmt, paged, block_size=bs)
    plan = page_plan(geom)
    assert plan is not None
    shape = geom.object_shape(chunk)
    shapes = [shape] * (n_objects - 1) + [(*shape[:2], last_tokens, shape[3])]

    def copies(objs: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return page_copies(plan, ids, [o.data_ptr() for o in objs], [o.shape[2] for o in objs], chunk, skip)

    # store: objects poisoned, then the pages copied out; equal to the reference's objects, byte for byte
    expected = [poisoned(s, dtype) for s in shapes]
    got = [e.clone() for e in expected]
    kvferry.transfer(paged, expected, ids, Direction.D2H, fmt, chunk, skip, backend="reference", block_size=bs)
    _run(*copies(got), to_objects=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(expected, got, strict=True))

    # retrieve: random objects into a random engine cache; every other byte of the engine stays as it was
    sources = [random_fill(torch.empty(s, dtype=dtype), gen) for s in shapes]
    targets = [
        make_paged(fmt, dims, nb, bs, dtype, one_buffer=one_buffer, generator=torch.Generator().manual_seed(seed + 1))
        for _ in range(2)
    ]
    kvferry.transfer(targets[0], sources, ids, Direction.H2D, fmt, chunk, skip, backend="reference", block_size=bs)
    target_geom = describe(fmt, targets[1], block_size=bs)
    target_plan = page_plan(target_geom)
    assert target_plan is not None
    dev, host, sizes = page_copies(target_plan, ids, [o.data_ptr() for o in sources], [o.shape[2] for o in sources],
                                   chunk, skip)  # fmt: skip
    _run(dev, host, sizes, to_objects=False)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(targets[0]), engine_bytes(targets[1]), strict=True))


def test_consecutive_blocks_of_one_object_are_one_copy() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, ModelDims(2, 2, 8), 16, 4)
    plan = page_plan(describe(fmt, paged, block_size=4))
    assert plan is not None and plan.adjacent
    ptrs, caps = [0x10000, 0x90000], [8, 8]
    dev, _, sizes = page_copies(plan, [3, 4, 5, 6], ptrs, caps, chunk_size=8, skip=0)  # two objects: two runs each
    assert len(dev) == 2 * 2 * 2 and set(sizes.tolist()) == {2 * plan.page}
    dev, _, sizes = page_copies(plan, [3, 9, 5, 6], ptrs, caps, chunk_size=8, skip=1)
    assert len(dev) == 2 * 2 * 2 and sorted(set(sizes.tolist())) == [plan.page, 2 * plan.page]


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS])
def test_page_size_is_a_blocks_rows(fmt: EngineKVFormat) -> None:
    dims = _dims(fmt, 3, 4, 8)
    paged = make_paged(fmt, dims, 5, 16, torch.bfloat16)
    geom = describe(fmt, paged, block_size=16)
    plan = page_plan(geom)
    assert plan is not None and plan.page == 16 * geom.width * 2
