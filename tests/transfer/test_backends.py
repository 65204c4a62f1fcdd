"""Every backend equals the reference, byte for byte, for every layout, both directions."""

from __future__ import annotations

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import ModelDims, make_paged, random_fill
from tests.conftest import dims_for, engine_bytes, kv_dtype_for, poisoned, tile_scale

F = EngineKVFormat
DIMS = ModelDims(nl=3, nh=2, hs=8, plane_widths=(8, 4))
PADDED = {F.NL_X_NB_BS_HS, F.NL_X_NB_BSV_BSS, F.NL_X_NB_BS_NH_HS, F.NL_X_NB_NH_BS_CS}


def _engine(fmt: F, dtype: torch.dtype, seed: int, one_buffer: bool, bs: int = 4, nb: int = 11):
    gen = torch.Generator().manual_seed(seed)
    pad = 5 if fmt in PADDED else 0
    dims = dims_for(fmt, DIMS)
    return make_paged(
        fmt, dims, nb, bs, kv_dtype_for(fmt, dtype), one_buffer=one_buffer, block_padding=pad, generator=gen
    )


def _objects(shape: tuple[int, ...], dtype: torch.dtype, last_tokens: int, count: int, fill: bool):
    shapes = [shape] * (count - 1) + [(*shape[:2], last_tokens, shape[3])]
    if fill:
        return [random_fill(torch.empty(s, dtype=dtype)) for s in shapes]
    return [poisoned(s, dtype) for s in shapes]


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("one_buffer", [True, False], ids=["one-buffer", "separate"])
def test_store_and_retrieve_match_reference(fmt: F, dtype: torch.dtype, one_buffer: bool) -> None:
    scale = tile_scale(fmt, 4)
    chunk, bs = 16 * scale, 4 * scale
    paged = _engine(fmt, dtype, 1, one_buffer, bs)
    geom = describe(fmt, paged, block_size=bs)
    kv_dtype = geom.dtype
    ids = torch.randperm(11, generator=torch.Generator().manual_seed(2))[:10]  # 2 full objects + 8 tokens
    shape = geom.object_shape(chunk)
    skip = 3

    stored = {}
    for backend in ("reference", "torch", "triton"):
        objs = _objects(shape, kv_dtype, 8 * scale, 3, fill=False)
        kvferry.transfer(paged, objs, ids, Direction.D2H, fmt, chunk, skip, backend=backend, block_size=bs)
        stored[backend] = [o.view(torch.uint8) for o in objs]
    for backend in ("torch", "triton"):
        for a, b in zip(stored["reference"], stored[backend], strict=True):
            assert torch.equal(a, b), backend
    # skipped tokens stay poisoned; copied ones do not
    first = stored["reference"][0].view(shape[0], shape[1], chunk, -1)
    assert bool((first[:, :, : skip * bs] == 0x5A).all())
    assert not bool((first[:, :, skip * bs :] == 0x5A).all())

    sources = _objects(shape, kv_dtype, 8 * scale, 3, fill=True)
    retrieved = {}
    for backend in ("reference", "torch", "triton"):
        target = _engine(fmt, dtype, 7, one_buffer, bs)
        before = engine_bytes(target)
        kvferry.transfer(target, sources, ids, Direction.H2D, fmt, chunk, skip, backend=backend, block_size=bs)
        retrieved[backend] = engine_bytes(target)
        assert any(not torch.equal(x, y) for x, y in zip(before, retrieved[backend], strict=True))
    for backend in ("torch", "triton"):
        for a, b in zip(retrieved["reference"], retrieved[backend], strict=True):
            assert torch.equal(a, b), backend


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_round_trip_into_other_blocks(fmt: F) -> None:
    """Store from one block set, retrieve into another: the engine holds the same KV at the new blocks."""
    scale = tile_scale(fmt, 4)
    chunk, bs = 8 * scale, 4 * scale
    src = _engine(fmt, torch.bfloat16, 3, True, bs)
    dst = _engine(fmt, torch.bfloat16, 4, True, bs)
    geom = describe(fmt, src, block_size=bs)
    ids_a = [3, 9, 0, 5, 7, 1]
    ids_b = [10, 2, 6, 4, 8, 1]
    objs = _objects(geom.object_shape(chunk), geom.dtype, chunk, 3, fill=False)
    kvferry.transfer(src, objs, ids_a, Direction.D2H, fmt, chunk, backend="torch", block_size=bs)
    kvferry.transfer(dst, objs, ids_b, Direction.H2D, fmt, chunk, backend="triton", block_size=bs)
    again = _objects(geom.object_shape(chunk), geom.dtype, chunk, 3, fill=False)
    kvferry.transfer(dst, again, ids_b, Direction.D2H, fmt, chunk, backend="reference", block_size=bs)
    for a, b in zip(objs, again, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fp8_moves_as_bytes() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, DIMS, 6, 4, torch.float8_e4m3fn)
    objs = [poisoned(kvferry.object_shape(fmt, paged, 8), torch.float8_e4m3fn) for _ in range(2)]
    kvferry.transfer(paged, objs, [5, 1, 0, 3], Direction.D2H, fmt, 8, backend="triton")
    ref = [poisoned(kvferry.object_shape(fmt, paged, 8), torch.float8_e4m3fn) for _ in range(2)]
    kvferry.transfer(paged, ref, [5, 1, 0, 3], Direction.D2H, fmt, 8, backend="reference")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, ref, strict=True))


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS, F.NL_X_NB_NH_BS_TWO_HS], ids=lambda f: f.name)
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_objects_as_one_tensor_equal_a_list(fmt: F, backend: str) -> None:
    """`objects` as one tensor [n, *object_shape] moves exactly what the list of its objects moves."""
    chunk, bs = 8, 4
    paged = _engine(fmt, torch.bfloat16, 3, False)
    geom = describe(fmt, paged, block_size=bs)
    ids = [3, 9, 0, 5, 7, 1]
    run = poisoned((3, *geom.object_shape(chunk)), geom.dtype)
    listed = _objects(geom.object_shape(chunk), geom.dtype, chunk, 3, fill=False)
    kvferry.transfer(paged, run, ids, Direction.D2H, fmt, chunk, 1, backend=backend, block_size=bs)
    kvferry.transfer(paged, listed, ids, Direction.D2H, fmt, chunk, 1, backend="reference", block_size=bs)
    assert torch.equal(run.view(torch.uint8), torch.stack(listed).view(torch.uint8))

    random_fill(run)
    got, want = _engine(fmt, torch.bfloat16, 5, False), _engine(fmt, torch.bfloat16, 5, False)
    kvferry.transfer(got, run, ids, Direction.H2D, fmt, chunk, 1, backend=backend, block_size=bs)
    kvferry.transfer(want, list(run), ids, Direction.H2D, fmt, chunk, 1, backend="reference", block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(want), strict=True))


@pytest.mark.parametrize(
    "fmt",
    [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_BS_NH_TWO_HS, F.VLLM_CPU_NL_X_NB_NH_KT_V],
    ids=lambda f: f.name,
)
@pytest.mark.parametrize("objects", [3, 1])
def test_cpu_retrieve_over_threads_matches_reference(monkeypatch: pytest.MonkeyPatch, fmt: F, objects: int) -> None:
    """The CPU retrieve's scatter jobs (rows, or pieces that are not single runs) spread over threads: one object per
    thread, or one object cut into spans when there are fewer objects than threads. Test tensors are far below the
    size that engages threads, so the threshold is lowered here."""
    from kvferry.kernels import cpu_threads

    monkeypatch.setattr(cpu_threads, "_MIN_PART_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    chunk, bs = 16, 4
    geom = describe(fmt, _engine(fmt, torch.bfloat16, 1, True, nb=16), block_size=bs)
    ids = torch.randperm(16, generator=torch.Generator().manual_seed(5))[: objects * chunk // bs]
    sources = _objects(geom.object_shape(chunk), geom.dtype, chunk, objects, fill=True)
    got, want = (_engine(fmt, torch.bfloat16, 7, True, nb=16) for _ in range(2))
    kvferry.transfer(got, sources, ids, Direction.H2D, fmt, chunk, 1, backend="torch", block_size=bs)
    kvferry.transfer(want, sources, ids, Direction.H2D, fmt, chunk, 1, backend="reference", block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(want), strict=True))


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_cpu_rows_of_a_storage_that_does_not_start_on_a_row(direction: Direction) -> None:
    """A server maps a client's shared memory from the file's start, 64 bytes before the KV (torch's header): the
    blocks are whole rows apart, but not from the storage's start. The torch backend still copies them as rows."""
    from kvferry.kernels.torch_copy import build_plan

    fmt, chunk = F.NL_X_TWO_NB_BS_NH_HS, 8
    plain = _engine(fmt, torch.bfloat16, 3, True)
    storage = torch.empty(plain[0].untyped_storage().nbytes() // 2 + 32, dtype=torch.bfloat16)
    storage[32:].copy_(torch.empty(0, dtype=torch.bfloat16).set_(plain[0].untyped_storage()))
    storage[:32].view(torch.uint8).fill_(0x5A)  # the header: never written
    shifted = [storage.as_strided(t.shape, t.stride(), t.storage_offset() + 32) for t in plain]
    geom = describe(fmt, shifted)
    assert build_plan(geom).span is not None
    ids = [7, 2, 9, 0]
    if direction is Direction.D2H:
        got, want = (_objects(geom.object_shape(chunk), geom.dtype, chunk, 2, fill=False) for _ in range(2))
        kvferry.transfer(shifted, got, ids, direction, fmt, chunk, 1, backend="torch")
        kvferry.transfer(plain, want, ids, direction, fmt, chunk, 1, backend="reference")
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    else:
        sources = _objects(geom.object_shape(chunk), geom.dtype, chunk, 2, fill=True)
        kvferry.transfer(shifted, sources, ids, direction, fmt, chunk, 1, backend="torch")
        kvferry.transfer(plain, sources, ids, direction, fmt, chunk, 1, backend="reference")
        assert torch.equal(storage[32:].view(torch.uint8), engine_bytes(plain)[0])
    assert bool((storage[:32].view(torch.uint8) == 0x5A).all())
