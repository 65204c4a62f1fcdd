"""The fp8 object codec: every backend writes the reference's bytes and reads back the reference's KV, for every
layout, both directions, a skipped prefix and a partial last object; the round trip's error is within its bound."""

from __future__ import annotations

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe, layout_of, with_codec
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.kernels.codec import dequantise_rows, quantise_rows
from tests.conftest import POISON, dims_for, engine_bytes, poisoned, tile_scale

F = EngineKVFormat
DIMS = ModelDims(nl=3, nh=2, hs=16, plane_widths=(32, 16))
CODED = [f for f in F if layout_of(f).element_sizes != (1,)]  # the indexer's cache is bytes: no codec for it


def _engine(fmt: F, dtype: torch.dtype, seed: int, bs: int, nb: int = 11):
    gen = torch.Generator().manual_seed(seed)
    return make_paged(fmt, dims_for(fmt, DIMS), nb, bs, dtype, generator=gen)


def _objects(shape: tuple[int, ...], last_tokens: int) -> list[torch.Tensor]:
    shapes = [shape, shape, (*shape[:2], last_tokens, shape[3])]
    return [poisoned(s, torch.uint8) for s in shapes]


@pytest.mark.parametrize("fmt", CODED, ids=lambda f: f.name)
def test_backends_match_reference(fmt: F) -> None:
    scale = tile_scale(fmt, 4)
    chunk, bs, skip = 16 * scale, 4 * scale, 3
    dtype = torch.float16 if fmt.value % 2 else torch.bfloat16  # both engine dtypes over the layouts
    paged = _engine(fmt, dtype, 1, bs)
    geom = with_codec(describe(fmt, paged, block_size=bs), "fp8")
    shape = geom.object_shape(chunk)
    assert shape[3] == geom.codec.row_bytes and geom.object_dtype == torch.uint8
    ids = torch.randperm(11, generator=torch.Generator().manual_seed(2))[:10]  # 2 full objects + a half one

    stored = {}
    for backend in ("reference", "torch", "triton"):
        objs = _objects(shape, 8 * scale)
        kvferry.transfer(paged, objs, ids, Direction.D2H, fmt, chunk, skip, backend=backend, geometry=geom)
        stored[backend] = objs
    for backend in ("torch", "triton"):
        for a, b in zip(stored["reference"], stored[backend], strict=True):
            assert torch.equal(a, b), backend
    first = stored["reference"][0]
    assert bool((first[:, :, : skip * bs] == POISON).all())  # the skipped prefix is untouched
    assert not bool((first[:, :, skip * bs :] == POISON).all())

    retrieved = {}
    for backend in ("reference", "torch", "triton"):
        target = _engine(fmt, dtype, 7, bs)
        before = engine_bytes(target)
        tgeom = with_codec(describe(fmt, target, block_size=bs), "fp8")
        kvferry.transfer(target, stored["reference"], ids, Direction.H2D, fmt, chunk, skip, backend=backend,
                         geometry=tgeom)  # fmt: skip
        retrieved[backend] = engine_bytes(target)
        assert any(not torch.equal(x, y) for x, y in zip(before, retrieved[backend], strict=True))
    for backend in ("torch", "triton"):
        for a, b in zip(retrieved["reference"], retrieved[backend], strict=True):
            assert torch.equal(a, b), backend


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS, F.NL_X_NB_NH_BS_CS], ids=lambda f: f.name)
def test_round_trip_error_within_bound(fmt: F) -> None:
    """Stored and read back into other blocks, each value is within 2**-4 + 2**-8 of its group's largest magnitude
    (e4m3 keeps 3 mantissa bits, the engine's bf16 8), and a group of zeros stays zeros."""
    bs, chunk = 4, 16
    src = _engine(fmt, torch.bfloat16, 3, bs)
    dst = _engine(fmt, torch.bfloat16, 4, bs)
    plain = describe(fmt, src, block_size=bs)
    geom = with_codec(plain, "fp8")
    ids = torch.arange(8)
    exact = [torch.empty(plain.object_shape(chunk), dtype=torch.bfloat16) for _ in range(2)]
    kvferry.transfer(src, exact, ids, Direction.D2H, fmt, chunk)
    exact[0][:, :, :4] *= torch.logspace(-3, 3, exact[0].shape[-1]).bfloat16()  # heavy tails across columns
    exact[1][:, :, 2] = 0
    kvferry.transfer(src, exact, ids, Direction.H2D, fmt, chunk)
    coded = [torch.empty(geom.object_shape(chunk), dtype=torch.uint8) for _ in range(2)]
    kvferry.transfer(src, coded, ids, Direction.D2H, fmt, chunk, geometry=geom)
    dst_geom = with_codec(describe(fmt, dst, block_size=bs), "fp8")
    kvferry.transfer(dst, coded, torch.arange(8, 16) % 11, Direction.H2D, fmt, chunk, geometry=dst_geom)
    back = [torch.empty_like(e) for e in exact]
    kvferry.transfer(dst, back, torch.arange(8, 16) % 11, Direction.D2H, fmt, chunk)
    g = geom.codec.group
    for e, b in zip(exact, back, strict=True):
        groups, got = e.float().unflatten(-1, (-1, g)), b.float().unflatten(-1, (-1, g))
        amax = groups.abs().amax(-1, keepdim=True)
        assert bool(((got - groups).abs() <= amax * (2**-4 + 2**-8)).all())
    assert bool((back[1][:, :, 2] == 0).all())


def test_quantise_rows_columns_and_layout() -> None:
    """A slice of columns (a tensor-parallel rank's heads) writes only its bytes and scales; the scales are the
    groups' largest magnitudes over 448, the bytes their e4m3 values."""
    geom = with_codec(describe(F.NL_X_TWO_NB_BS_NH_HS, _engine(F.NL_X_TWO_NB_BS_NH_HS, torch.bfloat16, 5, 4)), "fp8")
    codec = geom.codec
    values = torch.randn(3, codec.width).bfloat16()
    rows = poisoned((3, codec.row_bytes), torch.uint8)
    quantise_rows(values, codec, rows, codec.group, 2 * codec.group)
    assert bool((rows[:, : codec.group] == POISON).all()) and bool(
        (rows[:, 2 * codec.group : codec.width] == POISON).all()
    )
    scales = rows[:, codec.width :].view(torch.float32)
    want = values[:, codec.group : 2 * codec.group].float().abs().amax(-1) / 448
    assert torch.equal(scales[:, 1], want)
    out = torch.zeros(3, codec.width, dtype=torch.bfloat16)
    dequantise_rows(rows, codec, out, codec.group, 2 * codec.group)
    assert bool((out[:, : codec.group] == 0).all())
    group = values[:, codec.group : 2 * codec.group].float()
    # each value times 448 over its group's largest magnitude (dividing by the scale instead rounds differently in
    # the last bit, which now and then lands a value on the other side of an e4m3 rounding boundary)
    q = (group * (torch.full_like(want, 448.0) / group.abs().amax(-1))[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(rows[:, codec.group : 2 * codec.group], q.view(torch.uint8))


@pytest.mark.parametrize(
    ("dtype", "why"),
    [(torch.float32, "bf16 and fp16"), (torch.uint8, "fp8 already"), (torch.float8_e4m3fn, "fp8 already")],
)
def test_refused_dtypes_say_why(dtype: torch.dtype, why: str) -> None:
    paged = _engine(F.NL_X_TWO_NB_BS_NH_HS, dtype, 1, 4)
    with pytest.raises(ValueError, match=why):
        with_codec(describe(F.NL_X_TWO_NB_BS_NH_HS, paged), "fp8")
    with pytest.raises(ValueError, match="not one of"):
        with_codec(describe(F.NL_X_TWO_NB_BS_NH_HS, paged), "int4")


def test_small_heads_refused_and_geometry_shared() -> None:
    paged = make_paged(F.NL_X_TWO_NB_BS_NH_HS, ModelDims(nl=2, nh=2, hs=8), 4, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        with_codec(describe(F.NL_X_TWO_NB_BS_NH_HS, paged), "fp8")
    geom = describe(F.NL_X_TWO_NB_BS_NH_HS, _engine(F.NL_X_TWO_NB_BS_NH_HS, torch.bfloat16, 1, 4))
    assert with_codec(geom, "fp8") is with_codec(geom, "fp8") and with_codec(geom, "none") is geom
    assert with_codec(geom, "fp8").bytes_per_token * 2 > geom.bytes_per_token > with_codec(geom, "fp8").bytes_per_token


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_NH_BS_CS], ids=lambda f: f.name)
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_a_rank_writes_its_heads_values_and_scales_only(fmt: F, backend: str) -> None:
    """A tensor-parallel rank holding heads 1 and 2 of 4 writes the whole model's objects' bytes and scales of its
    heads, nothing else, and reads back the same KV as an engine of every head."""
    axis = layout_of(fmt).axes.index("NH")
    full = make_paged(
        fmt, ModelDims(nl=2, nh=4, hs=16), 7, 4, torch.bfloat16, generator=torch.Generator().manual_seed(1)
    )
    rank = [t.narrow(axis, 1, 2).clone() for t in full]
    geom = with_codec(describe(fmt, rank, heads=(1, 4)), "fp8")
    full_geom = with_codec(describe(fmt, full), "fp8")
    codec, ids = geom.codec, [6, 0, 3, 4]
    assert geom.object_shape(8) == full_geom.object_shape(8) and codec.groups == codec.width // 16
    got = [poisoned(geom.object_shape(8), torch.uint8) for _ in range(2)]
    want = [poisoned(geom.object_shape(8), torch.uint8) for _ in range(2)]
    kvferry.transfer(rank, got, ids, Direction.D2H, fmt, 8, 1, backend=backend, geometry=geom)
    kvferry.transfer(full, want, ids, Direction.D2H, fmt, 8, 1, backend="reference", geometry=full_geom)
    groups_per_head = codec.groups // 4
    mine = torch.zeros(codec.row_bytes, dtype=torch.bool)
    mine[codec.width // 4 : 3 * codec.width // 4] = True  # values of heads 1 and 2
    first_scale = codec.width + groups_per_head * 4
    mine[first_scale : first_scale + 2 * groups_per_head * 4] = True  # and their scales
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[:, :, :, mine][:, :, 4:], w[:, :, :, mine][:, :, 4:])
        assert bool((g[..., ~mine] == POISON).all())  # other heads' values and scales untouched
    assert bool((got[0][:, :, :4] == POISON).all())  # the skipped block (4 tokens) too
    back = [t.clone() for t in rank]
    for t in back:
        t.zero_()
    kvferry.transfer(back, want, ids, Direction.H2D, fmt, 8, 1, backend=backend, geometry=with_codec(
        describe(fmt, back, heads=(1, 4)), "fp8"))  # fmt: skip
    whole = [t.clone().zero_() for t in full]
    kvferry.transfer(whole, want, ids, Direction.H2D, fmt, 8, 1, backend="reference",
                     geometry=with_codec(describe(fmt, whole), "fp8"))  # fmt: skip
    for b, w in zip(back, whole, strict=True):
        assert torch.equal(b, w.narrow(axis, 1, 2)) and bool(b.any())


def test_forgetting_a_geometry_forgets_its_coded_plans() -> None:
    """An engine's KV going away (`forget_plans`) takes the plans of its coded geometry with it: they hold its
    tensors too (a server would keep a departed client's memory mapped)."""
    from kvferry.transfer import api, forget_plans

    paged = _engine(F.NL_X_TWO_NB_BS_NH_HS, torch.bfloat16, 1, 4)
    plain = describe(F.NL_X_TWO_NB_BS_NH_HS, paged)
    coded = with_codec(plain, "fp8")
    objs = [torch.empty(coded.object_shape(16), dtype=torch.uint8)]
    kvferry.transfer(paged, objs, [0, 1, 2, 3], Direction.D2H, F.NL_X_TWO_NB_BS_NH_HS, 16, geometry=coded)
    assert api._plans._cached(coded, "torch") is not None
    forget_plans(plain)
    assert api._plans._cached(coded, "torch") is None
