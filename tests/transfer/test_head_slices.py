"""An engine holding a slice of the model's KV heads (a tensor-parallel rank) moves its columns of whole objects."""

from __future__ import annotations

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe, layout_of
from kvferry.formats.synthetic import ModelDims, make_paged, random_fill
from tests.conftest import POISON, dims_for, engine_bytes, kv_dtype_for, leaves, poisoned, tile_scale

F = EngineKVFormat
WITH_HEADS = [f for f in F if "NH" in layout_of(f).axes]
TOTAL, FIRST, LOCAL = 5, 1, 2  # this rank holds heads 1 and 2 of 5


def _rank_of(fmt: F, full: object) -> object:
    """The engine of a rank holding heads FIRST..FIRST+LOCAL-1 of `full`'s: each tensor narrowed on NH, copied."""
    axis = layout_of(fmt).axes.index("NH")

    def narrow(node: object) -> object:
        if isinstance(node, torch.Tensor):
            return node.narrow(axis, FIRST, LOCAL).clone()
        return [narrow(child) for child in node]  # type: ignore[attr-defined]

    return narrow(full)


@pytest.mark.parametrize("fmt", WITH_HEADS, ids=lambda f: f.name)
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_a_rank_moves_its_heads_columns_only(fmt: F, backend: str) -> None:
    scale = tile_scale(fmt, 4)
    chunk, bs = 8 * scale, 4 * scale
    dims = dims_for(fmt, ModelDims(nl=2, nh=TOTAL, hs=8))
    dtype = kv_dtype_for(fmt, torch.bfloat16)
    full = make_paged(fmt, dims, 7, bs, dtype, generator=torch.Generator().manual_seed(1))
    rank = _rank_of(fmt, full)
    geom = describe(fmt, rank, bs, heads=(FIRST, TOTAL))
    full_geom = describe(fmt, full, bs)
    assert geom.object_shape(chunk) == full_geom.object_shape(chunk)
    per_head = geom.object_width // TOTAL
    mine = slice(FIRST * per_head, (FIRST + LOCAL) * per_head)
    ids, skip = [6, 0, 3, 4], 1

    got = [poisoned(geom.object_shape(chunk), dtype) for _ in range(2)]
    want = [poisoned(geom.object_shape(chunk), dtype) for _ in range(2)]
    kvferry.transfer(rank, got, ids, Direction.D2H, fmt, chunk, skip, backend=backend, geometry=geom)
    kvferry.transfer(full, want, ids, Direction.D2H, fmt, chunk, skip, backend="reference", geometry=full_geom)
    for g, w in zip(got, want, strict=True):
        g8, w8 = (x.view(torch.uint8).view(*x.shape[:3], -1) for x in (g, w))
        cols = slice(mine.start * g.element_size(), mine.stop * g.element_size())
        assert torch.equal(g8[..., cols], w8[..., cols])
        assert bool((g8[..., : cols.start] == POISON).all()) and bool((g8[..., cols.stop :] == POISON).all())

    sources = [random_fill(torch.empty(geom.object_shape(chunk), dtype=dtype)) for _ in range(2)]
    rank_after = _rank_of(fmt, full)
    full_after = make_paged(fmt, dims, 7, bs, dtype, generator=torch.Generator().manual_seed(1))
    kvferry.transfer(rank_after, sources, ids, Direction.H2D, fmt, chunk, skip, backend=backend,
                     geometry=describe(fmt, rank_after, bs, heads=(FIRST, TOTAL)))  # fmt: skip
    kvferry.transfer(full_after, sources, ids, Direction.H2D, fmt, chunk, skip, backend="reference", block_size=bs)
    want_rank = _rank_of(fmt, full_after)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(rank_after), engine_bytes(want_rank), strict=True))


def test_slices_that_do_not_fit_are_refused() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, ModelDims(nl=1, nh=2, hs=8), 3, 4)
    with pytest.raises(ValueError, match="do not fit in 3"):
        describe(fmt, paged, heads=(2, 3))
    with pytest.raises(ValueError, match="two integers"):
        describe(fmt, paged, heads=(0.5, 4))  # type: ignore[arg-type]
    mla = make_paged(F.NL_X_NB_BS_HS, ModelDims(nl=1, nh=1, hs=8), 3, 4)
    with pytest.raises(ValueError, match="no head axis"):
        describe(F.NL_X_NB_BS_HS, mla, heads=(0, 2))
    assert describe(fmt, paged, heads=(0, 2)).object_width == describe(fmt, paged).object_width == 16
    assert leaves(paged)[0].shape[3] == 2
