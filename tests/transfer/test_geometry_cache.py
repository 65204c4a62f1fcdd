"""`transfer` without `geometry=` recognises tensors it described before, and nothing else."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.transfer import api
from kvferry.transfer.geometry_cache import GeometryCache
from tests.conftest import poisoned

F = EngineKVFormat
DIMS = ModelDims(nl=3, nh=2, hs=8)


def test_the_same_tensors_get_the_same_geometry() -> None:
    cache = GeometryCache()
    paged = make_paged(F.NL_X_TWO_NB_BS_NH_HS, DIMS, 6, 4)
    first = cache.get(F.NL_X_TWO_NB_BS_NH_HS, paged, None)
    assert cache.get(int(F.NL_X_TWO_NB_BS_NH_HS), list(paged), None) is first  # a new list of the same tensors
    assert cache.get(F.NL_X_TWO_NB_BS_NH_HS, paged, 4) is not first  # the block size is part of the key


@pytest.mark.parametrize(
    "change",
    [
        lambda p: [t.view(torch.float16) for t in p],  # same bytes, another dtype
        lambda p: [p[0].clone(), *p[1:]],  # another buffer, same shape and strides
        lambda p: [t[:, :5] for t in p],  # fewer blocks: another shape
        lambda p: [t.transpose(2, 3).contiguous().transpose(2, 3) for t in p],  # other strides
        lambda p: p[:2],  # fewer layers
    ],
)
def test_any_change_is_described_afresh(change) -> None:  # type: ignore[no-untyped-def]
    cache = GeometryCache()
    paged = make_paged(F.NL_X_TWO_NB_BS_NH_HS, DIMS, 6, 4)
    first = cache.get(F.NL_X_TWO_NB_BS_NH_HS, paged, None)
    other = change(paged)
    got = cache.get(F.NL_X_TWO_NB_BS_NH_HS, other, None)
    assert got is not first
    assert next(t for s in got.stripes for t in s.tensors) is other[0]


def test_nestings_are_told_apart() -> None:
    cache = GeometryCache()
    fmt = F.TWO_X_NL_X_NB_BS_NH_HS  # [K layers, V layers]
    paged = make_paged(fmt, DIMS, 6, 4)
    assert cache.get(fmt, paged, None).nl == 3
    with pytest.raises(ValueError, match="must hold 2 entries"):
        cache.get(fmt, [*paged, paged[0]], None)
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        cache.get(fmt, [paged[0], [*paged[1][:2], "x"]], None)


def test_a_bad_request_after_a_good_one_is_still_refused() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, DIMS, 6, 4)
    shape = kvferry.object_shape(fmt, paged, 8)
    kvferry.transfer(paged, [poisoned(shape, torch.bfloat16)], [1, 2], Direction.D2H, fmt, 8)
    with pytest.raises(ValueError, match="shape"):
        kvferry.transfer([paged[0], paged[1][:, :3], paged[2]], [poisoned(shape, torch.bfloat16)], [1, 2],
                         Direction.D2H, fmt, 8)  # fmt: skip
    with pytest.raises(ValueError, match=r"block_ids\[1\]=6 is outside"):
        kvferry.transfer(paged, [poisoned(shape, torch.bfloat16)], [1, 6], Direction.D2H, fmt, 8)


def test_moves_the_right_bytes_after_the_tensors_change() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, DIMS, 6, 4)
    shape = kvferry.object_shape(fmt, paged, 8)
    kvferry.transfer(paged, [poisoned(shape, torch.bfloat16)], [1, 2], Direction.D2H, fmt, 8)
    other = make_paged(fmt, DIMS, 6, 4, generator=torch.Generator().manual_seed(3))
    got, want = poisoned(shape, torch.bfloat16), poisoned(shape, torch.bfloat16)
    kvferry.transfer(other, [got], [1, 2], Direction.D2H, fmt, 8)
    kvferry.transfer(other, [want], [1, 2], Direction.D2H, fmt, 8, backend="reference")
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_at_most_size_layouts_are_kept_alive() -> None:
    cache = GeometryCache()
    first = make_paged(F.NL_X_TWO_NB_BS_NH_HS, DIMS, 6, 4)
    alive = weakref.ref(first[0])
    cache.get(F.NL_X_TWO_NB_BS_NH_HS, first, None)
    del first
    for seed in range(cache.SIZE):
        cache.get(F.NL_X_TWO_NB_BS_NH_HS, make_paged(F.NL_X_TWO_NB_BS_NH_HS, DIMS, 6, 4), None)
        assert (alive() is None) == (seed == cache.SIZE - 1)
    gc.collect()
    assert alive() is None


def test_transfer_uses_the_process_cache() -> None:
    fmt = F.NL_X_NB_BS_HS
    paged = make_paged(fmt, ModelDims(nl=2, nh=1, hs=8), 5, 4)
    shape = kvferry.object_shape(fmt, paged, 4)
    kvferry.transfer(paged, [poisoned(shape, torch.bfloat16)], [3], Direction.D2H, fmt, 4)
    found = api._geometries.get(fmt, paged, None)
    kvferry.transfer(paged, [poisoned(shape, torch.bfloat16)], [3], Direction.D2H, fmt, 4)
    assert api._geometries.get(fmt, paged, None) is found
