"""The GPU transfer engine's own logic, run on the CPU: `TransferEngine.submit` with a driver that copies bytes.

CI has no GPU, but everything the staged pipeline decides is arithmetic: slices, slots, staging offsets, row ranges
and shifts, DMA runs of adjacent objects, the head object a store writes zero-copy, the schedule cache, the ring
turning over between requests (`cpu_engine.py` says how the GPU is stood in for). Tiny staging slots force row
slices. The result must equal the reference backend byte for byte.
"""

from __future__ import annotations

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.cuda.pinned import register_pinned
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import random_fill
from kvferry.kernels import triton_copy, triton_plan
from kvferry.memory import HostPool
from kvferry.transfer.lane import Lane
from kvferry.transfer.request import check, check_pool_addresses
from tests.conftest import engine_bytes
from tests.transfer.cpu_engine import (
    DONE,
    JOINED,
    META_READY,
    START,
    STREAMS,
    CopyingDriver,
    World,
)
from tests.transfer.test_backends import _engine

F = EngineKVFormat


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
    plan = triton_plan.build_plan(geom)
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
        got_plan = triton_plan.build_plan(describe(fmt, got, block_size=bs))
        engine.submit(got_plan, objs, ids, False, chunk, skip).wait()
        kvferry.transfer(expected, objs, ids, Direction.H2D, fmt, chunk, skip, backend="reference", block_size=bs)
        assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(expected), strict=True))
    assert world.launches > 0
    if mode == "row-slices":  # every object was cut: more launches than objects and stripes
        assert any(st.rows is not None for sched in engine._schedules.values() for st in sched.steps)
    calls = [call for call, *_ in engine._driver.log]
    if mode.startswith("whole-objects") and spread:  # scattered objects share a slice: batched, or one copy each
        assert ("batch" in calls) == (mode == "whole-objects")


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
    engine.submit(triton_plan.build_plan(geom), objs, request, True, chunk, 0).wait()
    want = [torch.empty(shape, dtype=geom.dtype) for _ in range(3)]
    kvferry.transfer(paged, want, ids, Direction.D2H, fmt, chunk, backend="reference", block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(objs, want, strict=True))
    assert [call for call, *_ in engine._driver.log].count("dtoh") == 1


def _logged_launches(monkeypatch: pytest.MonkeyPatch, drv: CopyingDriver, world: World) -> None:
    def logged(plan, stream, *args, **kwargs):  # type: ignore[no-untyped-def]
        drv.log.append(("launch", stream, 0))
        world.launch_raw(plan, stream, *args, **kwargs)

    monkeypatch.setattr(triton_copy, "launch_raw", logged)


def _small_slices(cpu_engine, monkeypatch):  # type: ignore[no-untyped-def]
    """An engine whose slices are one object each over two slots; its plan (and the engine KV the plan addresses:
    keep it alive), 6 objects, ids and world."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=24)
    geom = describe(fmt, paged, block_size=bs)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    engine, world = cpu_engine(pool, 2 * geom.bytes_per_token * chunk)  # a slice is one object (half a slot)
    _logged_launches(monkeypatch, engine._driver, world)
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 6)
    return engine, (triton_plan.build_plan(geom), paged), objs, torch.randperm(24), chunk, world


@pytest.mark.parametrize("to_objects", [True, False])
def test_a_slots_slices_run_on_its_stream(cpu_engine, monkeypatch, to_objects: bool) -> None:  # type: ignore[no-untyped-def]
    """Every DMA to or from a staging slot, and the gather (scatter) of its slice, run on that slot's stream, in
    every request: stream order alone frees a slot for its next slice, so a request's event calls do not grow with
    its slices. A metadata slot whose last user was seen finished takes no event query."""
    engine, (plan, _paged), objs, ids, chunk, world = _small_slices(cpu_engine, monkeypatch)
    drv, lane = engine._driver, engine._store if to_objects else engine._retrieve
    staging, ring_bytes = world.staging.data_ptr(), 2 * lane.slot_bytes
    event_calls = []
    for n in (1, 3, 6, 3):  # slices; the ring turns over within and between requests
        drv.log.clear()
        drv.copied.clear()
        engine.submit(plan, objs[:n], ids[: 4 * n], to_objects, chunk, 0).wait()
        slot_streams = []
        for stream, dst, src in drv.copied:
            at = (dst if 0 <= dst - staging < ring_bytes else src) - staging
            if 0 <= at < ring_bytes:  # a slice's DMA (not the metadata upload)
                slot_streams.append(lane.handles[at // lane.slot_bytes])
                assert stream == slot_streams[-1], "a slot's DMA off its stream"
        assert len(slot_streams) == n
        assert [s for call, s, _ in drv.log if call == "launch"] == slot_streams  # each slice's kernel beside it
        event_calls.append(sum(1 for call, *_ in drv.log if call in ("record", "wait")))
        assert not [e for e in drv.log if e[0] == "query"]  # every earlier request was seen finished
    assert event_calls[0] < event_calls[1] == event_calls[2] == event_calls[3]


@pytest.mark.parametrize("to_objects", [True, False])
def test_kernels_wait_for_the_callers_stream(cpu_engine, monkeypatch, to_objects: bool) -> None:  # type: ignore[no-untyped-def]
    """Every gather/scatter is ordered after the caller's stream (the model's writes / reads of its KV) and after
    its metadata upload; a retrieve's DMAs into staging are not (they touch no KV), so each goes first on its
    stream. The upload's event is recorded after the first kernel (off the path to the first GPU operation) but
    before a store's first DMA (which the other streams' gathers must not wait for). The request ends (its
    done-event) on a stream that waited for every other stream it used."""
    engine, (plan, _paged), objs, ids, chunk, _ = _small_slices(cpu_engine, monkeypatch)
    drv, lane = engine._driver, engine._store if to_objects else engine._retrieve
    engine.submit(plan, objs[:3], ids[:12], to_objects, chunk, 0).wait()
    log, home = drv.log, lane.handles[0]
    upload = next(i for i, e in enumerate(log) if e[0] == "htod" and e[1] == home)
    ready = log.index(("record", home, META_READY))
    assert log.index(("record", 0, START)) < upload < log.index(("launch", home, 0)) < ready
    if to_objects:
        assert ready < next(i for i, e in enumerate(log) if e[0] in ("dtoh", "batch") and e[1] == home)
    for stream in lane.handles:
        first_launch = log.index(("launch", stream, 0))
        ordered = log.index(("wait", stream, START))
        assert ordered < first_launch
        if stream != home:
            assert log.index(("record", home, META_READY)) < log.index(("wait", stream, META_READY)) < first_launch
        if not to_objects:
            copies = [i for i, e in enumerate(log) if e[0] in ("htod", "batch") and e[1] == stream and i != upload]
            assert copies[0] < ordered
    done = next(e for e in log if e[0] == "record" and e[2] >= DONE)
    for slot, stream in enumerate(lane.handles):
        if stream != done[1]:
            joined = log.index(("record", stream, JOINED + slot))
            assert joined < log.index(("wait", done[1], JOINED + slot)) < log.index(done)


CLIENT_EVENT = 77  # an event recorded elsewhere (a client's interprocess event), as the fake driver sees it


@pytest.mark.parametrize("mode", ["staged", "zero_copy"])
@pytest.mark.parametrize("to_objects", [True, False])
def test_kernels_wait_for_a_given_event_instead_of_the_callers_stream(cpu_engine, monkeypatch, to_objects: bool,
                                                                      mode: str) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """`after`: every gather/scatter waits for that event (what a server's copy of a client's STORE does), nothing is
    recorded on the caller's stream, and the bytes move as without it. A request with nothing to copy is done once
    the event is."""
    engine, (plan, paged), objs, ids, chunk, _ = _small_slices(cpu_engine, monkeypatch)
    drv, fmt = engine._driver, F.NL_X_TWO_NB_BS_NH_HS
    for o in objs[:3]:
        random_fill(o)
    want = [o.clone() for o in objs[:3]] if to_objects else _engine(fmt, torch.bfloat16, 3, False, nb=24)
    if to_objects:
        kvferry.transfer(paged, want, ids[:12], Direction.D2H, fmt, chunk, backend="reference", block_size=4)
    else:
        kvferry.transfer(want, objs[:3], ids[:12], Direction.H2D, fmt, chunk, backend="reference", block_size=4)
    engine.submit(plan, objs[:3], ids[:12], to_objects, chunk, 0, mode=mode, after=CLIENT_EVENT).wait()
    got, expected = (objs[:3], want) if to_objects else (engine_bytes(paged), engine_bytes(want))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    log = drv.log
    assert not [e for e in log if e[0] == "record" and e[1] == 0] and not [e for e in log if e[2] == START]
    launches = [i for i, e in enumerate(log) if e[0] == "launch"]
    assert launches and all(log.index(("wait", log[i][1], CLIENT_EVENT)) < i for i in launches)
    drv.log.clear()
    engine.submit(plan, objs[:1], ids[:4], to_objects, chunk, 4, mode=mode, after=CLIENT_EVENT).wait()  # all skipped
    done = next(e for e in drv.log if e[0] == "record" and e[2] >= DONE)
    assert drv.log.index(("wait", done[1], CLIENT_EVENT)) < drv.log.index(done) and done[1] in STREAMS


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
    plan = triton_plan.build_plan(geom)
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 3)
    host_ring = range(world.meta_host.data_ptr(), world.meta_host.data_ptr() + world.meta_host.nbytes)
    drv.requests_finish = False  # in flight: its slot stays taken
    engine.submit(plan, objs, torch.randperm(12), to_objects, chunk, 0, mode="zero_copy")
    assert [call for call, _, _ in drv.log].count("htod") == 0
    assert tables[-1] in host_ring
    engine.submit(plan, objs, torch.randperm(12), to_objects, chunk, 0, mode="zero_copy")
    assert tables[-1] in host_ring and tables[-1] != tables[-2]
    engine.submit(plan, objs, torch.randperm(12), to_objects, chunk, 0, mode="staged")
    assert tables[-1] not in host_ring and ("htod", STREAMS[0], 12 * 8 + len(objs) * 2 * 8 + 16) in drv.log


def test_a_metadata_slot_is_reused_once_its_request_finished(cpu_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The ring comes round: a slot whose last request may still read it (its done-event not fired) is passed over
    for a one-off buffer, and used again once that request has finished. A request seen finished (waited for)
    leaves the lane's in-flight list without another event query."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    engine, world = cpu_engine(pool, 1 << 16, "zero_copy")
    drv = engine._driver
    tables: list[int] = []
    queried: list[int] = []

    def logged(plan, stream, obj_ptr, off_ptr, cap_ptr, ids_ptr, *args, **kwargs):  # type: ignore[no-untyped-def]
        tables.append(ids_ptr)  # where the kernel would read its tables (the copies are not what is tested here)

    def query(event: int, real=drv.query) -> bool:  # type: ignore[no-untyped-def]
        queried.append(event)
        return real(event)

    monkeypatch.setattr(triton_copy, "launch_raw", logged)
    monkeypatch.setattr(drv, "query", query)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # the one-off buffer, on a machine with no GPU
    plan = triton_plan.build_plan(geom)
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 3)
    host_ring = range(world.meta_host.data_ptr(), world.meta_host.data_ptr() + world.meta_host.nbytes)

    def submit():  # type: ignore[no-untyped-def]
        return engine.submit(plan, objs, torch.randperm(12), True, chunk, 0)

    drv.requests_finish = False  # every request stays in flight
    for _ in range(Lane.META_SLOTS):
        submit()
    assert len(set(tables)) == Lane.META_SLOTS and all(t in host_ring for t in tables)
    submit()  # slot 0's request may still read it
    assert tables[-1] not in host_ring
    drv.requests_finish = True
    submit()  # now it has run
    assert tables[-1] == tables[0]
    waited = submit()
    waited.wait()
    queried.clear()
    submit()
    assert tables[-1] == tables[2] and waited._completion.event not in queried


@pytest.mark.parametrize("mode", ["row-slices", "whole-objects", "zero_copy"])
def test_objects_as_one_tensor_through_the_engine(cpu_engine, mode: str) -> None:  # type: ignore[no-untyped-def]
    """One tensor of objects through every engine path, with a skip into the first object (a store writes its
    tail zero-copy): the same bytes as the reference."""
    fmt, chunk, bs, skip = F.NL_X_TWO_NB_BS_NH_HS, 16, 4, 3
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    plan = triton_plan.build_plan(geom)
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
    got_plan = triton_plan.build_plan(describe(fmt, got, block_size=bs))
    engine.submit(got_plan, run, check(geom, run, ids, Direction.H2D, chunk, skip), False, chunk, skip).wait()
    kvferry.transfer(expected, run, ids, Direction.H2D, fmt, chunk, skip, backend="reference", block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(expected), strict=True))


@pytest.mark.parametrize("mode", ["row-slices", "whole-objects", "zero_copy"])
@pytest.mark.parametrize("skip", [0, 3])
def test_objects_by_address_with_a_list_of_ids(cpu_engine, mode: str, skip: int) -> None:  # type: ignore[no-untyped-def]
    """What a GPU store enqueues first: objects by address (`check_pool_addresses`), block ids given as a plain list
    (checked into a private int64 array): the same bytes as the reference, both directions."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    plan = triton_plan.build_plan(geom)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    row_bytes = chunk * geom.width * geom.element_size
    engine, _ = cpu_engine(pool, 2 * row_bytes if mode == "row-slices" else 1 << 16,
                           "zero_copy" if mode == "zero_copy" else "staged")  # fmt: skip
    shape = geom.object_shape(chunk)
    addresses = pool.try_reserve_many(shape, geom.dtype, 3)
    objs = pool.views(addresses, shape, geom.dtype)
    ids = torch.randperm(12).tolist()
    for o in objs:
        o.view(torch.uint8).fill_(0xA5)
    want = [o.clone() for o in objs]
    checked = check_pool_addresses(geom, addresses, ids, Direction.D2H, chunk, skip)
    assert str(checked.ids.dtype) == "int64" and checked.ids.tolist() == ids  # a private copy
    engine.submit(plan, addresses, checked, True, chunk, skip).wait()
    kvferry.transfer(paged, want, ids, Direction.D2H, fmt, chunk, skip, backend="reference", block_size=bs)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, want, strict=True))

    for o in objs:
        random_fill(o)
    got, expected = (_engine(fmt, torch.bfloat16, 7, False, nb=12) for _ in range(2))
    got_plan = triton_plan.build_plan(describe(fmt, got, block_size=bs))
    checked = check_pool_addresses(geom, addresses, ids, Direction.H2D, chunk, skip)
    engine.submit(got_plan, addresses, checked, False, chunk, skip).wait()
    kvferry.transfer(expected, objs, ids, Direction.H2D, fmt, chunk, skip, backend="reference", block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(expected), strict=True))
