"""Bad requests raise a clear error before any byte moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.memory import HostPool
from kvferry.transfer.request import check, check_pool_addresses, check_pool_objects
from tests.conftest import engine_bytes, poisoned

F = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
DIMS = ModelDims(nl=2, nh=2, hs=4)


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    paged = make_paged(F, DIMS, 8, 4)
    objs = [torch.randn(kvferry.object_shape(F, paged, 8)).to(torch.bfloat16) for _ in range(2)]
    return paged, objs


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda p, o, i: (p, o, [0, 1, 2, 8]), ValueError, r"block_ids\[3\]=8 is outside the pool of 8 blocks"),
        (lambda p, o, i: (p, o, [0, 1, -1, 2]), ValueError, r"block_ids\[2\]=-1"),
        (lambda p, o, i: (p, o, [0, 1, 2]), ValueError, "block_ids has 3 entries but the 2 objects hold 4 blocks"),
        (lambda p, o, i: (p, o, torch.tensor([0.0, 1, 2, 3])), TypeError, "integers"),
        (lambda p, o, i: (p, o, [0, 1, 2, 2]), ValueError, "repeats a block"),
        (lambda p, o, i: (p, [x.float() for x in o], i), TypeError, "dtype torch.float32"),
        (lambda p, o, i: (p, [o[0], o[1][:, :, :6]], i), ValueError, "expected"),
        (lambda p, o, i: (p, [o[0][:, :, :4], o[1]], i), ValueError, "only the last object may be partial"),
        (lambda p, o, i: (p, [o[0].transpose(2, 3).contiguous().transpose(2, 3), o[1]], i), ValueError, "contig"),
        (lambda p, o, i: (p, [], i), ValueError, "objects is empty"),
        (lambda p, o, i: (p[0], o, i), TypeError, "non-empty list"),
    ],
)
def test_bad_requests_touch_nothing(setup, mutate, error, match) -> None:  # type: ignore[no-untyped-def]
    paged, objs = setup
    paged2, objs2, ids = mutate(paged, objs, [0, 1, 2, 3])
    before = engine_bytes(paged)
    with pytest.raises(error, match=match):
        kvferry.transfer(paged2, objs2, ids, Direction.H2D, F, chunk_size=8)
    assert all(torch.equal(a, b) for a, b in zip(before, engine_bytes(paged), strict=True))


def test_bad_arguments(setup) -> None:  # type: ignore[no-untyped-def]
    paged, objs = setup
    with pytest.raises(ValueError, match="chunk_size=6 must be a positive multiple of the block size 4"):
        kvferry.transfer(paged, objs, [0, 1, 2, 3], Direction.D2H, F, chunk_size=6)
    with pytest.raises(ValueError, match="skip_prefix_blocks=5"):
        kvferry.transfer(paged, objs, [0, 1, 2, 3], Direction.D2H, F, chunk_size=8, skip_prefix_blocks=5)
    with pytest.raises(ValueError, match="direction"):
        kvferry.transfer(paged, objs, [0, 1, 2, 3], "sideways", F, chunk_size=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        kvferry.transfer(paged, objs, [0, 1, 2, 3], Direction.D2H, F, chunk_size=8, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a known EngineKVFormat"):
        kvferry.transfer(paged, objs, [0, 1, 2, 3], Direction.D2H, 55, chunk_size=8)


def test_skip_everything_moves_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    paged, _ = setup
    objs = [poisoned(kvferry.object_shape(F, paged, 8), torch.bfloat16) for _ in range(2)]
    for backend in ("reference", "torch", "triton"):
        kvferry.transfer(paged, objs, [0, 1, 2, 3], Direction.D2H, F, 8, skip_prefix_blocks=4, backend=backend)
        assert bool((objs[0].view(torch.uint8) == 0x5A).all())


def test_duplicate_ids_are_fine_for_a_store(setup) -> None:  # type: ignore[no-untyped-def]
    paged, objs = setup
    kvferry.transfer(paged, objs, [1, 1, 2, 2], Direction.D2H, F, chunk_size=8)
    assert torch.equal(objs[0][:, :, :4], objs[0][:, :, 4:])


@pytest.mark.parametrize("n_blocks", [4, 200])  # short id lists are checked as Python lists, long ones by numpy
def test_range_and_repeat_checks_at_every_length(n_blocks: int) -> None:
    paged = make_paged(F, DIMS, 256, 4)
    objs = [poisoned(kvferry.object_shape(F, paged, 4 * n_blocks), torch.bfloat16)]
    ids = torch.randperm(256)[:n_blocks]
    out_of_range, repeated = ids.clone(), ids.clone()
    out_of_range[-1], repeated[-1] = 256, ids[0]
    before = engine_bytes(paged)
    with pytest.raises(ValueError, match=rf"block_ids\[{n_blocks - 1}\]=256 is outside"):
        kvferry.transfer(paged, objs, out_of_range, Direction.D2H, F, chunk_size=4 * n_blocks)
    with pytest.raises(ValueError, match="repeats a block"):
        kvferry.transfer(paged, objs, repeated, Direction.H2D, F, chunk_size=4 * n_blocks)
    assert all(torch.equal(a, b) for a, b in zip(before, engine_bytes(paged), strict=True))
    kvferry.transfer(paged, objs, repeated, Direction.D2H, F, chunk_size=4 * n_blocks)  # a store may repeat
    kvferry.transfer(paged, objs, ids, Direction.H2D, F, chunk_size=4 * n_blocks, skip_prefix_blocks=1)


def test_objects_as_one_tensor_are_checked_as_a_whole(setup) -> None:  # type: ignore[no-untyped-def]
    paged, objs = setup
    run = torch.stack(objs)  # [2, *object_shape]
    before = engine_bytes(paged)
    for bad, error, match in [
        (run[:, :, :, :4], ValueError, r"objects given as one tensor must be \[n >= 1, 2, 2, 8, 8\]"),
        (run[:0], ValueError, "n >= 1"),
        (run[0], ValueError, "must be a torch.Tensor|one tensor"),
        (run.float(), TypeError, "dtype torch.float32"),
        (run.transpose(3, 4).contiguous().transpose(3, 4), ValueError, "contiguous"),
    ]:
        with pytest.raises(error, match=match):
            kvferry.transfer(paged, bad, [0, 1, 2, 3], Direction.H2D, F, chunk_size=8)
    assert all(torch.equal(a, b) for a, b in zip(before, engine_bytes(paged), strict=True))


def test_pool_object_check_agrees_with_the_full_check() -> None:
    """The cache's lighter check gives what `check` gives for the pool's own objects, and still refuses a wrong
    shape or dtype (a tier's header shapes promoted objects), bad block ids and a retrieve that repeats a block."""
    paged = make_paged(F, DIMS, 16, 4)
    geom = describe(F, paged)
    pool = HostPool(1 << 20)
    objs = [pool.alloc(geom.object_shape(8), geom.dtype) for _ in range(2)]
    for direction, skip in ((Direction.D2H, 0), (Direction.H2D, 1)):
        full = check(geom, objs, [3, 1, 7, 2], direction, 8, skip)
        light = check_pool_objects(geom, objs, [3, 1, 7, 2], direction, 8, skip)
        assert (list(light.ids), light.ptrs, light.caps, light.rows) == (
            full.ids.tolist(),
            full.ptrs,
            full.caps,
            full.rows,
        )
        assert light.on_host and light.one_allocation
    other = pool.alloc((*geom.object_shape(8)[:3], geom.width // 2), geom.dtype)
    for bad_objs, ids, direction, match in [
        ([objs[0], other], [0, 1, 2, 3], Direction.D2H, r"objects\[1\] is .* expected whole objects"),
        ([objs[0], objs[1].view(torch.float16)], [0, 1, 2, 3], Direction.D2H, "expected whole objects"),
        ([objs[0][:, :, :4]], [0], Direction.D2H, "expected whole objects"),
        ([], [], Direction.D2H, "objects is empty"),
        (objs, [0, 1, 2, 16], Direction.D2H, r"block_ids\[3\]=16 is outside the pool of 16 blocks"),
        (objs, [0, 1, 2], Direction.D2H, "block_ids has 3 entries but the 2 objects hold 4 blocks"),
        (objs, [0, 1, 2, 2], Direction.H2D, "repeats a block"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_pool_objects(geom, bad_objs, ids, direction, 8, 0)


def test_pool_address_check_refuses_what_the_object_check_refuses() -> None:
    """Objects by address (just reserved in the pool): the ids become a private int64 array (as for objects); they
    are refused for what `check_pool_objects` refuses them for, and a list holding something other than ints is
    refused as the array path refuses it."""
    paged = make_paged(F, DIMS, 16, 4)
    geom = describe(F, paged)
    pool = HostPool(1 << 20)
    addresses = pool.try_reserve_many(geom.object_shape(8), geom.dtype, 2)
    objs = pool.views(addresses, geom.object_shape(8), geom.dtype)
    for ids in ([3, 1, 7, 2], (3, 1, 7, 2), torch.tensor([3, 1, 7, 2]), np.array([3, 1, 7, 2])):
        for direction, skip in ((Direction.D2H, 0), (Direction.H2D, 1)):
            by_address = check_pool_addresses(geom, addresses, ids, direction, 8, skip)
            by_object = check_pool_objects(geom, objs, ids, direction, 8, skip)
            assert list(by_address.ids) == list(by_object.ids) == [3, 1, 7, 2]
            assert by_address.ids.dtype == by_object.ids.dtype == np.int64
            a, o = by_address, by_object
            assert (a.ptrs, a.caps, a.rows, a.one_allocation) == (o.ptrs, o.caps, o.rows, o.one_allocation)
            if isinstance(ids, torch.Tensor):  # what was checked is what moves: a later write to the ids is not seen
                ids[0] = 99
                assert a.ids[0] == o.ids[0] == 3
                ids[0] = 3
    for ids, direction, skip, error, match in [
        ([0, 1, 2, 16], Direction.D2H, 0, ValueError, r"block_ids\[3\]=16 is outside the pool of 16 blocks"),
        ([0, -1, 2, 3], Direction.D2H, 0, ValueError, r"block_ids\[1\]=-1 is outside"),
        ([99, 1, 2, 3], Direction.D2H, 1, None, None),  # a skipped id is never read
        ([0, 1, 2], Direction.D2H, 0, ValueError, "block_ids has 3 entries but the 2 objects hold 4 blocks"),
        ([0, 1, 2, 2], Direction.H2D, 0, ValueError, "repeats a block"),
        ([0, 1, 2, "x"], Direction.D2H, 0, TypeError, "block_ids must be a sequence of ints"),
        ([0, 1, 2, "3"], Direction.D2H, 0, TypeError, "got <U21 values"),  # not parsed
        ([0, 1, 2, 3.5], Direction.D2H, 0, TypeError, "got float64 values"),  # not truncated
        ([0, 1, 2, 3], Direction.D2H, 5, ValueError, "skip_prefix_blocks=5 must be within 0..4"),
    ]:
        if error is None:
            check_pool_addresses(geom, addresses, ids, direction, 8, skip)
            continue
        with pytest.raises(error, match=match):
            check_pool_addresses(geom, addresses, ids, direction, 8, skip)
    with pytest.raises(ValueError, match="addresses is empty"):
        check_pool_addresses(geom, [], [], Direction.D2H, 8, 0)


def test_a_partial_last_object_by_address_is_checked_as_the_same_object_is() -> None:
    """``last_tokens``: a tail's object last, by address, holds the blocks and capacity its view would."""
    paged = make_paged(F, DIMS, 16, 4)
    geom = describe(F, paged)
    pool = HostPool(1 << 20)
    addresses = pool.try_reserve_many(geom.object_shape(8), geom.dtype, 2)
    objs = [
        *pool.views(addresses[:1], geom.object_shape(8), geom.dtype),
        torch.empty(geom.object_shape(4), dtype=geom.dtype),
    ]
    for direction, skip in ((Direction.D2H, 0), (Direction.H2D, 2)):
        by_address = check_pool_addresses(geom, addresses, [3, 1, 7], direction, 8, skip, last_tokens=4)
        by_object = check(geom, objs, [3, 1, 7], direction, 8, skip)
        assert list(by_address.ids) == list(by_object.ids) == [3, 1, 7]
        assert by_address.caps == by_object.caps == [8, 4]
    for last, match in [(6, "last_tokens=6 must be a multiple of 4"), (12, "within 1..8"), (0, "within 1..8")]:
        with pytest.raises(ValueError, match=match):
            check_pool_addresses(geom, addresses, [3, 1, 7], Direction.D2H, 8, 0, last_tokens=last)
    with pytest.raises(ValueError, match="block_ids has 4 entries but the 2 objects hold 3 blocks"):
        check_pool_addresses(geom, addresses, [3, 1, 7, 2], Direction.D2H, 8, 0, last_tokens=4)
