"""Hypothesis: odd sizes, any number of objects, partial last object, any skip, both directions; the engine's KV in
one buffer or a tensor per plane and layer, objects apart or back to back in memory."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe, layout_of
from kvferry.formats.synthetic import ModelDims, make_paged, random_fill
from tests.conftest import dims_for, engine_bytes, kv_dtype_for, poisoned, tile_scale


@st.composite
def requests(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    fmt = draw(st.sampled_from(list(EngineKVFormat)))
    dims = ModelDims(
        nl=draw(st.integers(1, 3)),
        nh=draw(st.integers(1, 3)),
        hs=draw(st.integers(1, 9)),
        plane_widths=tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))),
    )
    if "NP" not in layout_of(fmt).nesting:
        dims = dims_for(fmt, ModelDims(dims.nl, dims.nh, dims.hs))
    bs = draw(st.integers(1, 5)) * tile_scale(fmt, 1)
    per_object = draw(st.integers(1, 3))
    n_objects = draw(st.integers(1, 3))
    last_blocks = draw(st.integers(1, per_object))
    n_ids = (n_objects - 1) * per_object + last_blocks
    nb = n_ids + draw(st.integers(0, 4))
    ids = draw(st.permutations(list(range(nb))))[:n_ids]
    skip = draw(st.integers(0, n_ids))
    dtype = kv_dtype_for(fmt, draw(st.sampled_from([torch.bfloat16, torch.float32, torch.uint8])))
    layout = draw(st.sampled_from(["one-buffer", "separate"])), draw(st.sampled_from(["adjacent", "apart"]))
    return fmt, dims, bs, per_object * bs, n_objects, last_blocks * bs, nb, ids, skip, dtype, layout


def _carve(
    shapes: list[tuple[int, ...]], adjacent: bool, make: Callable[[tuple[int, ...]], torch.Tensor]
) -> list[torch.Tensor]:
    """Objects from `make(shape)`: each its own tensor, or back to back in one (as a pool hands them out)."""
    if not adjacent:
        return [make(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    flat = make((sum(sizes),))
    return [piece.view(s) for piece, s in zip(flat.split(sizes), shapes, strict=True)]


@settings(max_examples=60, deadline=None)
@given(requests(), st.integers(0, 2**31))
def test_backends_agree_on_any_request(req, seed: int) -> None:  # type: ignore[no-untyped-def]
    fmt, dims, bs, chunk, n_objects, last_tokens, nb, ids, skip, dtype, (buffers, objects) = req
    one_buffer, adjacent = buffers == "one-buffer", objects == "adjacent"
    gen = torch.Generator().manual_seed(seed)
    paged = make_paged(fmt, dims, nb, bs, dtype, one_buffer=one_buffer, generator=gen)
    geom = describe(fmt, paged, block_size=bs)
    shape = geom.object_shape(chunk)
    shapes = [shape] * (n_objects - 1) + [(*shape[:2], last_tokens, shape[3])]

    results = []
    for backend in ("reference", "torch", "triton"):
        objs = _carve(shapes, adjacent, lambda s: poisoned(s, dtype))
        kvferry.transfer(paged, objs, ids, Direction.D2H, fmt, chunk, skip, backend=backend, block_size=bs)
        results.append([o.view(torch.uint8) for o in objs])
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r, strict=True))

    sources = _carve(shapes, adjacent, lambda s: random_fill(torch.empty(s, dtype=dtype), gen))
    engines = []
    for backend in ("reference", "torch", "triton"):
        target = make_paged(
            fmt, dims, nb, bs, dtype, one_buffer=one_buffer, generator=torch.Generator().manual_seed(seed + 1)
        )
        kvferry.transfer(target, sources, ids, Direction.H2D, fmt, chunk, skip, backend=backend, block_size=bs)
        engines.append(engine_bytes(target))
    assert all(torch.equal(a, b) for r in engines[1:] for a, b in zip(engines[0], r, strict=True))
