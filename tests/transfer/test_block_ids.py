"""The one check of a request's block ids, what it returns, and the transfer taking checked ids without a second
check (and checking again those that do not cover its request)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.transfer.block_ids import CheckedBlockIds, check_block_ids
from tests.conftest import engine_bytes

F = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
DIMS = ModelDims(nl=2, nh=2, hs=4)
NB, BS = 1000, 4


@pytest.mark.parametrize("n", [5, 300])  # a few ids are checked as a Python list, many by numpy
@pytest.mark.parametrize("kind", ["list", "tuple", "int32 array", "uint16 array", "int64 tensor", "int32 tensor"])
def test_checked_ids_are_a_private_int64_copy_of_the_first_needed(n: int, kind: str) -> None:
    values = np.random.default_rng(n).permutation(NB)[: n + 3]  # 3 more than needed: not read
    given = {
        "list": values.tolist(),
        "tuple": tuple(values.tolist()),
        "int32 array": values.astype(np.int32),
        "uint16 array": values.astype(np.uint16),
        "int64 tensor": torch.from_numpy(values.copy()),
        "int32 tensor": torch.from_numpy(values.astype(np.int32)),
    }[kind]
    checked = check_block_ids(given, NB, BS, needed=n, start=1, distinct=True)
    assert checked.ids.dtype == np.int64 and checked.ids.tolist() == values[:n].tolist()
    assert (len(checked), checked.num_blocks, checked.checked_from, checked.distinct) == (n, NB, 1, True)
    if kind != "tuple":
        given[0] = given[1]  # type: ignore[index]  # the caller's ids change after the check
        assert checked.ids[0] == values[0]


@pytest.mark.parametrize("n", [6, 300])
def test_refused_ids_name_the_first_bad_one_after_start(n: int) -> None:
    rng = np.random.default_rng(n)
    ids = rng.permutation(NB)[:n].tolist()
    bad = int(rng.integers(2, n))
    outside, repeated = list(ids), list(ids)
    outside[bad], repeated[bad] = NB + bad, ids[bad - 1]
    with pytest.raises(ValueError, match=rf"block_ids\[{bad}\]={NB + bad} is outside the pool of {NB} blocks"):
        check_block_ids(outside, NB, BS, needed=n, start=2, distinct=False)
    with pytest.raises(ValueError, match="repeats a block"):
        check_block_ids(repeated, NB, BS, needed=n, start=2, distinct=True)
    assert check_block_ids(repeated, NB, BS, needed=n, start=2, distinct=False).ids.tolist() == repeated  # a store
    outside[0], outside[bad] = -1, ids[bad]  # before `start`: not copied, not checked
    assert check_block_ids(outside, NB, BS, needed=n, start=1, distinct=True).ids.tolist() == outside
    with pytest.raises(ValueError, match=r"block_ids\[0\]=-1 is outside"):
        check_block_ids(outside, NB, BS, needed=n, distinct=True)
    with pytest.raises(ValueError, match=f"block_ids has {n} entries but the full chunks of tokens need {n + 1}"):
        check_block_ids(ids, NB, BS, needed=n + 1, distinct=False)
    with pytest.raises(ValueError, match=f"block_ids has {n} entries but the 2 objects hold {n - 1} blocks"):
        check_block_ids(ids, NB, BS, needed=n - 1, distinct=False, objects=2)
    with pytest.raises(TypeError, match="block_ids must hold integers"):
        check_block_ids(np.array(ids, dtype=np.float64), NB, BS, needed=n, distinct=False)
    with pytest.raises(ValueError, match="block_ids must be 1-D"):
        check_block_ids(torch.tensor(ids).view(2, -1), NB, BS, needed=n, distinct=False)


def test_slices_and_takes_keep_what_was_checked() -> None:
    rng = np.random.default_rng(3)
    ids = rng.permutation(NB)[:40].tolist()
    checked = check_block_ids(ids, NB, BS, needed=40, start=8, distinct=True)
    part = checked[4:20]
    assert part.ids.tolist() == ids[4:20] and (part.checked_from, part.num_blocks, part.distinct) == (4, NB, True)
    assert checked[10:30].checked_from == 0
    positions = np.array([2, 3, 9, 10, 33], dtype=np.int64)
    taken = checked.take(positions)
    assert taken.ids.tolist() == [ids[p] for p in positions] and taken.checked_from == 2
    assert part.covers(NB, 4, distinct=True) and part.covers(NB + 1, 7, distinct=False)
    assert not part.covers(NB, 3, distinct=False)  # ids before `checked_from` were never checked
    assert not part.covers(NB - 1, 4, distinct=False)  # checked against a larger pool than this one
    store = check_block_ids(ids, NB, BS, needed=40, distinct=False)
    assert not store.covers(NB, 0, distinct=True) and store.covers(NB, 39, distinct=True)  # one id cannot repeat


def test_the_transfer_takes_checked_ids_and_checks_raw_ones(block_id_checks: list[bool]) -> None:
    paged, expected = (make_paged(F, DIMS, 16, BS, generator=torch.Generator().manual_seed(5)) for _ in range(2))
    objs = [torch.randn(kvferry.object_shape(F, paged, 8)).to(torch.bfloat16) for _ in range(2)]
    raw = [9, 2, 14, 5]
    kvferry.transfer(expected, objs, raw, Direction.H2D, F, chunk_size=8, skip_prefix_blocks=1)
    assert block_id_checks == [True]  # ids given to kvferry.transfer as they are: checked
    checked = check_block_ids(raw, 16, BS, needed=4, start=1, distinct=True)
    block_id_checks.clear()
    kvferry.transfer(paged, objs, checked, Direction.H2D, F, chunk_size=8, skip_prefix_blocks=1)
    assert block_id_checks == []  # checked already, for this request: taken as they are
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(paged), engine_bytes(expected), strict=True))


def test_checked_ids_that_do_not_cover_the_transfer_are_checked_again(block_id_checks: list[bool]) -> None:
    paged = make_paged(F, DIMS, 16, BS)
    objs = [torch.randn(kvferry.object_shape(F, paged, 8)).to(torch.bfloat16) for _ in range(2)]
    before = engine_bytes(paged)
    refused: list[tuple[CheckedBlockIds, int, str]] = [
        (check_block_ids([1, 2, 3, 1], 16, BS, needed=4, distinct=False), 0, "repeats a block"),  # a store's
        (check_block_ids([99, 2, 3, 4], 16, BS, needed=4, start=1, distinct=True), 0, r"block_ids\[0\]=99"),
        (check_block_ids([1, 2, 3, 20], 32, BS, needed=4, distinct=True), 0, r"block_ids\[3\]=20 is outside"),
    ]
    block_id_checks.clear()
    for checked, skip, match in refused:
        with pytest.raises(ValueError, match=match):
            kvferry.transfer(paged, objs, checked, Direction.H2D, F, chunk_size=8, skip_prefix_blocks=skip)
    assert block_id_checks == [True] * len(refused)
    assert all(torch.equal(a, b) for a, b in zip(before, engine_bytes(paged), strict=True))
