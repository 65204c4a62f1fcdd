"""The kernel's row slices: how the GPU pipeline moves one large object through staging in pieces.

`rows=(r0, r1)` copies only object rows r0..r1-1 (plane * NL + layer); `obj_shift` moves them to the start of a
staging buffer. Two slices that cover every row must equal the whole object, in both directions, for every layout
(fused layouts have several stripes per row). Runs in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.kernels import triton_copy, triton_plan
from tests.conftest import engine_bytes, poisoned, tile_scale
from tests.transfer.test_backends import _engine

F = EngineKVFormat


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_two_row_slices_equal_the_whole_object(fmt: F) -> None:
    scale = tile_scale(fmt, 4)
    chunk, bs = 8 * scale, 4 * scale
    paged = _engine(fmt, torch.bfloat16, 5, False, bs)
    geom = describe(fmt, paged, block_size=bs)
    plan = triton_plan.build_plan(geom)
    shape = geom.object_shape(chunk)
    n_rows = shape[0] * shape[1]
    split = n_rows // 2 + 1 if n_rows > 2 else 1
    ids = torch.tensor([6, 2])
    table = torch.tensor([[0], [chunk]])
    words_per_row = chunk * geom.width * geom.element_size // plan.word  # one object row, all its tokens

    whole = poisoned(shape, geom.dtype)
    kvferry.transfer(paged, [whole], ids, Direction.D2H, fmt, chunk, backend="reference", block_size=bs)
    pieces = []
    for r0, r1 in ((0, split), (split, n_rows)):
        staging = poisoned((r1 - r0, chunk, shape[3]), geom.dtype)
        triton_copy.launch(plan, staging, table, ids, True, chunk, 0, chunk, rows=(r0, r1),
                           obj_shift=-r0 * words_per_row)  # fmt: skip
        pieces.append(staging)
    assert torch.equal(torch.cat(pieces).view(torch.uint8), whole.view(n_rows, chunk, -1).view(torch.uint8))

    source = whole.view(n_rows, chunk, -1)
    want = _engine(fmt, torch.bfloat16, 9, False, bs)
    kvferry.transfer(want, [whole], ids, Direction.H2D, fmt, chunk, backend="reference", block_size=bs)
    got = _engine(fmt, torch.bfloat16, 9, False, bs)
    got_geom = describe(fmt, got, block_size=bs)
    got_plan = triton_plan.build_plan(got_geom)
    for r0, r1 in ((0, split), (split, n_rows)):
        staging = source[r0:r1].clone()
        triton_copy.launch(got_plan, staging, table, ids, False, chunk, 0, chunk, rows=(r0, r1),
                           obj_shift=-r0 * words_per_row)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(want), strict=True))


def test_a_row_range_outside_a_stripe_copies_nothing() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = _engine(fmt, torch.bfloat16, 5, False)
    geom = describe(fmt, paged, block_size=4)
    staging = poisoned((1, 8, geom.width), geom.dtype)
    before = staging.clone()
    table = torch.tensor([[0], [8]])
    triton_copy.launch(triton_plan.build_plan(geom), staging, table, torch.tensor([1, 2]), True, 8, 0, 8,
                       rows=(100, 101))  # fmt: skip
    assert torch.equal(staging.view(torch.uint8), before.view(torch.uint8))
