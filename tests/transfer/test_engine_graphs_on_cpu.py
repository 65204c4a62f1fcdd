"""The engine's choice of a CUDA graph for a one-object request, run on the CPU (`cpu_engine.py`'s copying driver).

A captured graph needs a GPU; what the engine decides around it does not: which requests take one, one graph per
shape and lane reused with other objects and ids, the tables it uploads for each launch, the staged path when a
capture is refused, and a dropped engine's graphs let go. A stand-in graph moves its object with the Triton
kernel's CPU path, reading the ids, offset and capacity from the pinned tables the engine uploaded, so a wrong
table or address shows as wrong bytes.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.cuda.driver import CudaError
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import random_fill
from kvferry.kernels import triton_copy, triton_plan
from kvferry.memory import HostPool
from kvferry.transfer import gpu_engine
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.graphed import pieces_for, tables_bytes
from tests.conftest import engine_bytes
from tests.transfer.cpu_engine import CopyingDriver, World, completion_init, engine_on
from tests.transfer.test_backends import _engine

F = EngineKVFormat
FMT, CHUNK, BS = F.NL_X_TWO_NB_BS_NH_HS, 16, 4


@pytest.fixture
def graph_engine(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """make(pool, slot_bytes, refuse=False, **config) -> (engine, world, graphs made): a TransferEngine on CPU
    memory whose graphs are stand-ins (or whose captures are refused)."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(gpu_engine.Completion, "__init__", completion_init)
    monkeypatch.setattr(gpu_engine.Completion, "__del__", lambda self: None)

    def make(pool: HostPool, slot_bytes: int, refuse: bool = False, **config: Any):  # type: ignore[no-untyped-def]
        world = World(pool, slot_bytes)
        monkeypatch.setattr(triton_copy, "launch_raw", world.launch_raw)
        made: list[StandInGraph] = []

        class StandInGraph:
            def __init__(self, drv: Any, context: int, plan: triton_plan.TritonPlan, n_ids: int, cap: int,
                         rows: int, chunk_size: int, to_objects: bool, programs: int | None, stream: int, slot: int,
                         host: int) -> None:  # fmt: skip
                if refuse:
                    raise CudaError("cuStreamBeginCapture_v2 failed: CUDA_ERROR_NOT_SUPPORTED (801)")
                self.plan, self.n_ids, self.cap, self.chunk, self.to_objects = plan, n_ids, cap, chunk_size, to_objects
                self.stream, self.slot, self.launches = stream, slot, 0
                made.append(self)

            def launch(self, host: int, tables_host: int, start: int) -> None:
                tables = world.ints_at(tables_host)[: self.n_ids + 2]
                ids, offset, cap = tables[: self.n_ids], tables[self.n_ids :][:1], tables[self.n_ids + 1 :]
                triton_copy.launch(self.plan, world.tensor_at(host), [offset, cap], ids, self.to_objects,
                                   self.chunk, 0, self.n_ids * self.plan.bs)  # fmt: skip
                self.launches += 1

        monkeypatch.setattr(gpu_engine, "ObjectGraph", StandInGraph)
        engine = engine_on(world, CopyingDriver(), EngineConfig(slot_bytes=slot_bytes, **config))
        engine._graphs_failed = not engine.config.graph_max_bytes
        return engine, world, made

    return make


def _setup(seed: int = 3):  # type: ignore[no-untyped-def]
    paged = _engine(FMT, torch.bfloat16, seed, False)
    geom = describe(FMT, paged, block_size=BS)
    return paged, geom, triton_plan.build_plan(geom), HostPool(1 << 20, alignment=256, pin=False)


def plan_of(paged: Any) -> triton_plan.TritonPlan:
    return triton_plan.build_plan(describe(FMT, paged, block_size=BS))


def _store_checked(engine: gpu_engine.TransferEngine, plan, paged, objs, ids, skip: int = 0) -> None:  # type: ignore[no-untyped-def]
    for o in objs:
        o.view(torch.uint8).fill_(0xA5)
    want = [o.clone() for o in objs]
    engine.submit(plan, objs, ids, True, CHUNK, skip).wait()
    kvferry.transfer(paged, want, ids, Direction.D2H, FMT, CHUNK, skip, backend="reference", block_size=BS)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, want, strict=True))


def test_one_object_requests_replay_one_graph_per_shape(graph_engine) -> None:  # type: ignore[no-untyped-def]
    paged, geom, plan, pool = _setup()
    engine, world, made = graph_engine(pool, 1 << 16)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # other objects and ids each turn, one graph per direction and plan
        obj = pool.alloc(geom.object_shape(CHUNK), geom.dtype)
        ids = torch.randperm(11, generator=gen)[: CHUNK // BS]
        _store_checked(engine, plan, paged, [obj], ids)
        random_fill(obj)
        got, expected = (_engine(FMT, torch.bfloat16, 7, False) for _ in range(2))
        engine.submit(plan_of(got), [obj], ids, False, CHUNK, 0).wait()
        kvferry.transfer(expected, [obj], ids, Direction.H2D, FMT, CHUNK, backend="reference", block_size=BS)
        assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(expected), strict=True))
    stores = [g for g in made if g.to_objects]
    assert len(stores) == 1 and stores[0].launches == 3
    assert len(made) == 4  # each retrieve had an engine KV (a plan) of its own
    assert world.launches == 0, "no request took the staged pipeline"
    lane = engine._store
    assert (stores[0].stream, stores[0].slot) == (lane.handles[0], lane.staging_ptr)
    assert list(plan.graphs) == [(lane.ref, CHUNK // BS, CHUNK, CHUNK, True)]


@pytest.mark.parametrize("case", ["skip", "two objects", "zero_copy", "graphs off", "larger than a slot"])
def test_requests_a_graph_does_not_serve_take_the_staged_path(graph_engine, case: str) -> None:  # type: ignore[no-untyped-def]
    paged, geom, plan, pool = _setup()
    shape = geom.object_shape(CHUNK)
    obj_bytes = CHUNK * geom.bytes_per_token
    slot_bytes = obj_bytes + tables_bytes(CHUNK // BS) - 8 if case == "larger than a slot" else 1 << 16
    config: dict[str, Any] = {"mode": "zero_copy"} if case == "zero_copy" else {}
    if case == "graphs off":
        config["graph_max_bytes"] = 0
    engine, world, made = graph_engine(pool, slot_bytes, **config)
    n_objects = 2 if case == "two objects" else 1
    objs = [pool.alloc(shape, geom.dtype) for _ in range(n_objects)]
    ids = torch.randperm(11, generator=torch.Generator().manual_seed(2))[: CHUNK // BS * n_objects]
    _store_checked(engine, plan, paged, objs, ids, skip=1 if case == "skip" else 0)
    assert made == [] and world.launches > 0


def test_a_refused_capture_is_tried_once_then_the_staged_path(graph_engine, caplog) -> None:  # type: ignore[no-untyped-def]
    paged, geom, plan, pool = _setup()
    engine, world, _ = graph_engine(pool, 1 << 16, refuse=True)
    obj = pool.alloc(geom.object_shape(CHUNK), geom.dtype)
    with caplog.at_level(logging.WARNING, logger="kvferry.transfer.gpu_engine"):
        for seed in (1, 2):
            ids = torch.randperm(11, generator=torch.Generator().manual_seed(seed))[:4]
            _store_checked(engine, plan, paged, [obj], ids)
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graph capture failed (cuStreamBeginCapture_v2 failed: CUDA_ERROR_NOT_SUPPORTED (801)): one-object "
        "requests take the staged path"
    ]
    assert engine._graphs_failed and world.launches > 0 and plan.graphs == {}


def test_graphs_of_a_dropped_engine_go_and_a_plan_keeps_at_most_sixteen(graph_engine) -> None:  # type: ignore[no-untyped-def]
    paged, geom, plan, pool = _setup()
    obj = pool.alloc(geom.object_shape(CHUNK), geom.dtype)
    ids = torch.arange(4)
    first, _, made = graph_engine(pool, 1 << 16)
    _store_checked(first, plan, paged, [obj], ids)
    assert len(made) == 1
    del first, made
    gc.collect()
    engine, world, _ = graph_engine(pool, 1 << 16)
    _store_checked(engine, plan, paged, [obj], ids)
    assert [key[0]() for key in plan.graphs] == [engine._store]  # the dropped lane's graph is no longer held

    holders = [torch.empty(1) for _ in range(15)]  # 15 more graphs of live lanes: the plan is full
    for i, h in enumerate(holders):
        plan.graphs[(weakref.ref(h), i, 0, 0, True)] = object()
    _store_checked(engine, plan, paged, [obj], ids)  # its own graph is still found
    cap8 = pool.alloc((*geom.object_shape(CHUNK)[:2], 8, geom.object_shape(CHUNK)[3]), geom.dtype)
    _store_checked(engine, plan, paged, [cap8], ids[:2])  # a new shape: no room, the staged path
    assert len(plan.graphs) == 16 and world.launches > 0


def test_row_ranges_per_object() -> None:
    mib = 1 << 20
    assert [pieces_for(3 * mib, 48, True), pieces_for(3 * mib, 48, False)] == [2, 1]
    assert [pieces_for(32 * mib, 64, True), pieces_for(32 * mib, 64, False)] == [2, 2]
    assert pieces_for(32 * mib, 1, True) == 1  # never more ranges than rows
    assert [tables_bytes(16), tables_bytes(30), tables_bytes(31)] == [256, 256, 512]
