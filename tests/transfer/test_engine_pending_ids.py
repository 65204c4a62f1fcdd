"""A GPU retrieve whose block ids are pending (`PendingBlockIds`, as the cache passes them): the engine enqueues the
first DMA into each staging slot, then runs the check, then uploads the ids and scatters; a check that fails leaves
the KV unwritten and the lane ready for the next request. On the CPU stand-in of `cpu_engine.py`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import random_fill
from kvferry.kernels import triton_plan
from kvferry.memory import HostPool
from kvferry.transfer.block_ids import CheckedBlockIds, PendingBlockIds, check_block_ids
from kvferry.transfer.request import check_pool_objects
from tests.conftest import engine_bytes
from tests.transfer.test_backends import _engine
from tests.transfer.test_engine_on_cpu import _logged_launches

FMT, CHUNK, BS, NB, OBJECTS = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 16, 4, 24, 4


def _setup(cpu_engine, monkeypatch):  # type: ignore[no-untyped-def]
    """An engine whose slices are one object each over two slots, 4 random objects, and a random engine KV."""
    geom = describe(FMT, _engine(FMT, torch.bfloat16, 3, False, nb=NB), block_size=BS)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    engine, world = cpu_engine(pool, 2 * geom.bytes_per_token * CHUNK)
    _logged_launches(monkeypatch, engine._driver, world)
    objs = pool.try_alloc_many(geom.object_shape(CHUNK), geom.dtype, OBJECTS)
    for o in objs:
        random_fill(o)
    kv = _engine(FMT, torch.bfloat16, 7, False, nb=NB)
    return engine, geom, objs, kv


def _retrieve(engine: Any, geom: Any, objs: list[torch.Tensor], kv: Any, check: Any) -> None:
    pending = PendingBlockIds(OBJECTS * CHUNK // BS, check)
    checked = check_pool_objects(geom, objs, pending, Direction.H2D, CHUNK, 0)
    plan = triton_plan.build_plan(describe(FMT, kv, block_size=BS))
    engine.submit(plan, objs, checked, False, CHUNK, 0).wait()


def test_the_first_dma_into_each_slot_goes_before_the_check(cpu_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine, geom, objs, kv = _setup(cpu_engine, monkeypatch)
    drv = engine._driver
    ids = torch.randperm(NB)[: OBJECTS * CHUNK // BS].tolist()

    def check() -> CheckedBlockIds:
        drv.log.append(("check", -1, 0))
        return check_block_ids(ids, geom.nb, BS, needed=len(ids), distinct=True)

    expected = [t.clone() for t in kv] if isinstance(kv, list) else kv.clone()
    _retrieve(engine, geom, objs, kv, check)
    kvferry.transfer(expected, objs, ids, Direction.H2D, FMT, CHUNK, 0, backend="reference", block_size=BS)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(kv), engine_bytes(expected), strict=True))
    log = drv.log
    at = log.index(("check", -1, 0))
    object_bytes = geom.bytes_per_token * CHUNK
    before = [e for e in log[:at] if e[0] in ("htod", "batch")]
    assert before == [("htod", s, object_bytes) for s in engine._retrieve.handles]  # one slice per slot
    assert not [e for e in log[:at] if e[0] == "launch"]
    assert next(e for e in log[at:] if e[0] == "htod")[2] < object_bytes  # the ids' upload, after the check


def test_a_failed_check_writes_no_block_and_the_lane_goes_on(cpu_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine, geom, objs, kv = _setup(cpu_engine, monkeypatch)
    before = [t.clone() for t in engine_bytes(kv)]
    repeated = [1, 2, 3, 1, *range(4, 4 + OBJECTS * CHUNK // BS - 4)]

    def check() -> CheckedBlockIds:
        return check_block_ids(repeated, geom.nb, BS, needed=len(repeated), distinct=True)

    with pytest.raises(ValueError, match="repeats a block"):
        _retrieve(engine, geom, objs, kv, check)
    assert not [e for e in engine._driver.log if e[0] == "launch"]
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(kv), before, strict=True))
    ids = torch.randperm(NB)[: len(repeated)].tolist()  # the next request, on the same lane and ring
    _retrieve(engine, geom, objs, kv, lambda: check_block_ids(ids, geom.nb, BS, needed=len(ids), distinct=True))
    expected = _engine(FMT, torch.bfloat16, 7, False, nb=NB)
    kvferry.transfer(expected, objs, ids, Direction.H2D, FMT, CHUNK, 0, backend="reference", block_size=BS)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(kv), engine_bytes(expected), strict=True))
