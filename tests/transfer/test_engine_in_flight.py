"""What a GPU engine's requests in flight hold, and what they do not (`TransferEngine.submit`, run on the CPU as in
`test_engine_on_cpu.py`)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvferry.formats import EngineKVFormat, describe
from kvferry.kernels import triton_plan
from kvferry.memory import HostPool
from tests.transfer.test_backends import _engine

F = EngineKVFormat


@pytest.mark.parametrize("mode", ["staged", "zero_copy"])
@pytest.mark.parametrize("to_objects", [True, False], ids=["store", "retrieve"])
def test_a_request_in_flight_keeps_its_plans_tables(cpu_engine, mode: str, to_objects: bool) -> None:  # type: ignore[no-untyped-def]
    """A caller may drop a plan while requests made with it are still queued (`forget_plans`, the layout LRU): their
    kernels read its device tables when they run, so the tables live until those requests have run, and no
    longer."""
    fmt, chunk, bs = F.NL_X_TWO_NB_BS_NH_HS, 16, 4
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=bs)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    engine, _ = cpu_engine(pool, 1 << 16, mode)
    objs = pool.try_alloc_many(geom.object_shape(chunk), geom.dtype, 3)
    plan = triton_plan.build_plan(geom)
    tables = [weakref.ref(t) for s in plan.stripes for t in (s.eng_off, s.ent_row)]
    engine._driver.requests_finish = False  # queued behind the caller's stream
    handle = engine.submit(plan, objs, torch.randperm(12), to_objects, chunk, 0)
    del plan
    gc.collect()
    assert all(t() is not None for t in tables), "a queued request's plan tables were freed"
    engine._driver.requests_finish = True
    handle.wait()
    engine.submit(triton_plan.build_plan(geom), objs, torch.randperm(12), to_objects, chunk, 0)  # retires the first
    gc.collect()
    assert all(t() is None for t in tables), "a finished request still holds its plan"


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
    handle = engine.submit(triton_plan.build_plan(geom), objs, torch.randperm(12), True, chunk, 0)
    lanes = [weakref.ref(engine._store), weakref.ref(engine._retrieve)]
    gc.disable()
    try:
        del engine
        assert [lane() for lane in lanes] == [None, None]
    finally:
        gc.enable()
    handle.wait()  # its lane is gone: nothing to tell
