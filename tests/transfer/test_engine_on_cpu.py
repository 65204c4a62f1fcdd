"""The GPU transfer engine's own logic, run on the CPU: `TransferEngine.submit` with a driver that copies bytes.

CI has no GPU, but everything the staged pipeline decides is arithmetic: slices, slots, staging offsets, row ranges
and shifts, DMA runs of adjacent objects, the head object a store writes zero-copy, the schedule cache, the ring
turning over between requests (`cpu_engine.py` says how the GPU is stood in for). Tiny staging slots force row
slices. The result must equal the reference backend byte for byte.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import random_fill
from kvferry.kernels import triton_copy
from kvferry.memory import HostPool
from kvferry.transfer import gpu_engine
from kvferry.transfer.pinned import register_pinned
from kvferry.transfer.request import check
from tests.conftest import engine_bytes
from tests.transfer.cpu_engine import (
    CS,
    KS,
    META,
    SLOT_FREE,
    START,
    CopyingDriver,
    World,
    completion_init,
    engine_on,
)
from tests.transfer.test_backends import _engine

F = EngineKVFormat


@pytest.fixture
def cpu_engine(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """make(pool, slot_bytes, mode) -> (TransferEngine on CPU memory, its world)."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(gpu_engine.Completion, "__init__", completion_init)
    monkeypatch.setattr(gpu_engine.Completion, "__del__", lambda self: None)

    def make(pool: HostPool, slot_bytes: int, mode: str = "staged", batch: bool = True):  # type: ignore[no-untyped-def]
        world = World(pool, slot_bytes)
        monkeypatch.setattr(triton_copy, "launch_raw", world.launch_raw)
        config = gpu_engine.EngineConfig(slot_bytes=slot_bytes, mode=mode, batch_dma=batch)
        return engine_on(world, CopyingDriver(), config), world

    return make


CASES = [  # (format, skip_prefix_blocks, spread objects in the pool)
    (F.NL_X_TWO_NB_BS_NH_HS, 0, True),
    (F.NL_X_TWO_NB_BS_NH_HS, 3, False),  # skip into the first object: a store writes its tail zero-copy
    (F.NL_X_NB_BS_HS, 4, True),  # padded MLA, skip a whole object
    (F.NL_X_NP_X_NB_BS_ONE_HS, 1, False),  # planes
    (F.NL_X_NB_NH_BS_TWO_HS, 0, False),  # fused K/V: several stripes per object row
    (F.NB_NL_TWO_BS_NH_HS, 5, True),
]


@pytest.mark.parametrize(("fmt", "skip", "spread"), CASES, ids=lambda c: getattr(c, "name", str(c)))
@pytest.mark.parametrize("mode", ["row-slices", "whole-objects", "whole-objects-unbatched", "zero_copy"])
def test_submit_equals_the_reference(cpu_engine, fmt: F, skip: int, spread: bool, mode: str) -> None:  # type: ignore[no-untyped-def]
    chunk, bs = 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False)
    geom = describe(fmt, paged, block_size=bs)
    plan = triton_copy.build_plan(geom)
    shape = geom.object_shape(chunk)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    row_bytes = chunk * geom.width * geom.element_size  # one object row: the smallest slice
    slot_bytes = 2 * row_bytes if mode == "row-slices" else 1 << 16
    engine, world = cpu_engine(
        pool, slot_bytes, "zero_copy" if mode == "zero_copy" else "staged", "unbatched" not in mode
    )
    ids = torch.randperm(11, generator=torch.Generator().manual_seed(4))[:10]  # 2 full objects + a half one
    objs = []
    for s in [shape, shape, (*shape[:2], 8, shape[3])]:
        objs.append(pool.alloc(s, geom.dtype))
        if spread:
            pool.alloc((256,), torch.uint8)

    for turn in range(3):  # the ring moves on between requests; later ones reuse the cached schedule
        for o in objs:
            o.view(torch.uint8).fill_(0xA5)
        want = [o.clone() for o in objs]  # a skipped head keeps what the object held
        engine.submit(plan, objs, ids, True, chunk, skip).wait()
        kvferry.transfer(paged, want, ids, Direction.D2H, fmt, chunk, skip, backend="reference", block_size=bs)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, want, strict=True))

        for o in objs:
            random_fill(o)
        got, expected = (_engine(fmt, torch.bfloat16, 7 + turn, False) for _ in range(2))
        got_plan = triton_copy.build_plan(describe(fmt, got, block_size=bs))
        engine.submit(got_plan, objs, ids, False, chunk, skip).wait()
        kvferry.transfer(expected, objs, ids, Direction.H2D, fmt, chunk, skip, backend="reference", block_size=bs)
        assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(expected), strict=True))
    assert world.launches > 0
    if mode == "row-slices":  # every object was cut: more launches than objects and stripes
        assert any(st.rows is not None for sched in engine._schedules.values() for st in sched.steps)
    copies = [call for call, stream, _ in engine._driver.log if call in ("dtoh", "htod", "batch") and stream != KS]
    if mode.startswith("whole-objects") and spread:  # scattered objects share a slice: batched, or one copy each
        assert ("batch" in copies) == (mode == "whole-objects")


@pytest.mark.parametrize("given", ["list", "list-in-registered-slab", "one-tensor"])
def test_adjacent_objects_move_in_one_dma(cpu_engine, given: str) -> None:  # type: ignore[no-untyped-def]
    """Objects back to back in one allocation are one DMA per slice: a list whose slab is a registered pinned one
    (known without asking the objects), a list in another allocation (each pair's storage compared), or the
    objects given as one tensor."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    if given == "list-in-registered-slab":
        register_pinned(pool, pool.slab.data_ptr(), pool.slab.numel())
    engine, _ = cpu_engine(pool, 1 << 16)
    shape = geom.object_shape(chunk)
    if given == "one-tensor":
        objs: list[torch.Tensor] | torch.Tensor = pool.alloc((3, *shape), geom.dtype)
    else:
        objs = pool.try_alloc_many(shape, geom.dtype, 3)
        assert [o.data_ptr() - objs[0].data_ptr() for o in objs] == [0, objs[0].nbytes, 2 * objs[0].nbytes]
    ids = torch.randperm(12)
    request = check(geom, objs, ids, Direction.D2H, chunk, 0)
    engine.submit(triton_copy.build_plan(geom), objs, request, True, chunk, 0).wait()
    want = [torch.empty(shape, dtype=geom.dtype) for _ in range(3)]
    kvferry.transfer(paged, want, ids, Direction.D2H, fmt, chunk, backend="reference", block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(objs, want, strict=True))
    assert [call for call, *_ in engine._driver.log].count("dtoh") == 1


def _slot_waits(log: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return [e for e in log if e[0] == "wait" and SLOT_FREE <= e[2] < SLOT_FREE + 10]


@pytest.mark.parametrize("to_objects", [True, False])
def test_slots_of_finished_requests_are_used_without_waiting(cpu_engine, to_objects: bool) -> None:  # type: ignore[no-untyped-def]
    """A slot whose last user was seen finished takes no stream wait, a metadata slot no query (each a driver
    call before the request's first GPU operation); a slot still owned by an unfinished request, or reused within
    one request, is waited for."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    plan = triton_copy.build_plan(geom)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    obj_bytes = geom.bytes_per_token * chunk
    engine, _ = cpu_engine(pool, 2 * obj_bytes)  # a slice is one object (half a slot), two slots
    drv = engine._driver
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 3)
    ids = torch.randperm(12)
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0).wait()  # slot 0, seen finished
    drv.log.clear()
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0).wait()  # slot 1, never used
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0).wait()  # slot 0 again, its user finished
    assert _slot_waits(drv.log) == []
    assert not [e for e in drv.log if e[0] == "query" or (e[0] == "wait" and e[2] >= META)]

    drv.requests_finish = False  # from here on no request is seen finished
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0)  # slot 1: its user finished
    assert _slot_waits(drv.log) == []
    drv.log.clear()
    engine.submit(plan, objs[:3], ids, to_objects, chunk, 0)  # slots 0, 1, 0: the last two are busy
    stream = KS if to_objects else CS
    assert _slot_waits(drv.log) == [("wait", stream, SLOT_FREE + 1), ("wait", stream, SLOT_FREE)]

    # A request seen finished late frees only the slots nobody took since.
    first = engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0)  # slot 1
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0)  # slot 0
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0)  # slot 1, taken from `first`
    drv.requests_finish = True
    first.wait()
    drv.requests_finish = False
    drv.log.clear()
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0)  # slot 0
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 0)  # slot 1: still busy
    assert _slot_waits(drv.log) == [("wait", stream, SLOT_FREE), ("wait", stream, SLOT_FREE + 1)]


@pytest.mark.parametrize("to_objects", [True, False])
def test_kernels_wait_for_the_callers_stream(cpu_engine, monkeypatch, to_objects: bool) -> None:  # type: ignore[no-untyped-def]
    """Every gather/scatter is ordered after the caller's stream (the model's writes / reads of its KV); a
    retrieve's first DMA into staging is not (it touches no KV), so it goes first."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    engine, world = cpu_engine(pool, 2 * geom.bytes_per_token * chunk)
    drv = engine._driver

    def logged(*args, **kwargs):  # type: ignore[no-untyped-def]
        drv.log.append(("launch", KS, 0))
        world.launch_raw(*args, **kwargs)

    monkeypatch.setattr(triton_copy, "launch_raw", logged)
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 3)
    engine.submit(triton_copy.build_plan(geom), objs, torch.randperm(12), to_objects, chunk, 0).wait()
    calls = [(call, stream) for call, stream, _ in drv.log]
    ordered = drv.log.index(("wait", KS, START))
    assert drv.log.index(("record", 0, START)) < ordered < calls.index(("launch", KS))  # 0: the caller's stream
    assert calls.count(("launch", KS)) == 3
    if not to_objects:
        assert calls.index(("htod", CS)) < ordered


@pytest.mark.parametrize("to_objects", [True, False])
def test_zero_copy_kernels_read_the_pinned_metadata_slot(cpu_engine, monkeypatch, to_objects: bool) -> None:  # type: ignore[no-untyped-def]
    """A zero-copy request's kernel reads its block ids and tables in the pinned ring itself (no upload before the
    launch); a staged request's kernels read a device copy. The slot is not reused while the kernel may read it."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    engine, world = cpu_engine(pool, 2 * geom.bytes_per_token * chunk)
    drv = engine._driver
    tables: list[int] = []

    def logged(plan, stream, obj_ptr, off_ptr, cap_ptr, ids_ptr, *args, **kwargs):  # type: ignore[no-untyped-def]
        tables.append(ids_ptr)
        world.launch_raw(plan, stream, obj_ptr, off_ptr, cap_ptr, ids_ptr, *args, **kwargs)

    monkeypatch.setattr(triton_copy, "launch_raw", logged)
    plan = triton_copy.build_plan(geom)
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 3)
    host_ring = range(world.meta_host.data_ptr(), world.meta_host.data_ptr() + world.meta_host.nbytes)
    drv.requests_finish = False  # in flight: its slot stays taken
    engine.submit(plan, objs, torch.randperm(12), to_objects, chunk, 0, mode="zero_copy")
    assert [call for call, _, _ in drv.log].count("htod") == 0
    assert tables[-1] in host_ring
    engine.submit(plan, objs, torch.randperm(12), to_objects, chunk, 0, mode="zero_copy")
    assert tables[-1] in host_ring and tables[-1] != tables[-2]
    engine.submit(plan, objs, torch.randperm(12), to_objects, chunk, 0, mode="staged")
    assert tables[-1] not in host_ring and ("htod", KS, 12 * 8 + len(objs) * 2 * 8 + 16) in drv.log


def test_a_dropped_engine_frees_its_lanes_without_the_collector(cpu_engine) -> None:  # type: ignore[no-untyped-def]
    """Requests in flight reach their lane weakly: a lane holds them, so a strong link back would be a cycle that
    keeps a dropped engine's staging memory until the garbage collector runs."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    engine, _ = cpu_engine(pool, 1 << 16)
    engine._driver.requests_finish = False  # the request stays in flight
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 3)
    handle = engine.submit(triton_copy.build_plan(geom), objs, torch.randperm(12), True, chunk, 0)
    lanes = [weakref.ref(engine._store), weakref.ref(engine._retrieve)]
    gc.disable()
    try:
        del engine
        assert [lane() for lane in lanes] == [None, None]
    finally:
        gc.enable()
    handle.wait()  # its lane is gone: nothing to tell


@pytest.mark.parametrize("mode", ["row-slices", "whole-objects", "zero_copy"])
def test_objects_as_one_tensor_through_the_engine(cpu_engine, mode: str) -> None:  # type: ignore[no-untyped-def]
    """One tensor of objects through every engine path, with a skip into the first object (a store writes its
    tail zero-copy): the same bytes as the reference."""
    fmt, chunk, bs, skip = F.NL_X_TWO_NB_BS_NH_HS, 16, 4, 3
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    plan = triton_copy.build_plan(geom)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    row_bytes = chunk * geom.width * geom.element_size
    slot_bytes = 2 * row_bytes if mode == "row-slices" else 1 << 16
    engine, _ = cpu_engine(pool, slot_bytes, "zero_copy" if mode == "zero_copy" else "staged")
    run = pool.alloc((3, *geom.object_shape(chunk)), geom.dtype)
    ids = torch.randperm(12)
    run.view(torch.uint8).fill_(0xA5)
    want = run.clone()  # a skipped head keeps what the object held
    engine.submit(plan, run, check(geom, run, ids, Direction.D2H, chunk, skip), True, chunk, skip).wait()
    kvferry.transfer(paged, want, ids, Direction.D2H, fmt, chunk, skip, backend="reference", block_size=bs)
    assert torch.equal(run.view(torch.uint8), want.view(torch.uint8))

    random_fill(run)
    got, expected = (_engine(fmt, torch.bfloat16, 7, False, nb=12) for _ in range(2))
    got_plan = triton_copy.build_plan(describe(fmt, got, block_size=bs))
    engine.submit(got_plan, run, check(geom, run, ids, Direction.H2D, chunk, skip), False, chunk, skip).wait()
    kvferry.transfer(expected, run, ids, Direction.H2D, fmt, chunk, skip, backend="reference", block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(expected), strict=True))
