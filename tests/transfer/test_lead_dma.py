"""A retrieve's first DMA started before the request is known whole (`TransferEngine.lead`), on the engine run on
the CPU (`cpu_engine.py`): the request skips that DMA only where it is exactly its first slice's first parts (a lead
spans the slice's objects that lie back to back from its first; the slice's other objects then follow), redoes it
otherwise, and the lane is free again however the lead ends (used, released, handed to a store)."""

from __future__ import annotations

import itertools

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import random_fill
from kvferry.kernels import triton_plan
from kvferry.memory import HostPool
from kvferry.transfer.schedule import lead_bytes
from tests.conftest import engine_bytes
from tests.transfer.test_backends import _engine

F = EngineKVFormat
CHUNK, BS, OBJECTS = 16, 4, 3


def _case(cpu_engine, slot_objects: float, adjacent: bool = False):  # type: ignore[no-untyped-def]
    """An engine whose staging slots hold `slot_objects` objects, three pool objects (scattered, or back to back
    as a store allocates them), block ids."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = _engine(fmt, torch.bfloat16, 3, False, nb=12)
    geom = describe(fmt, paged, block_size=BS)
    shape = geom.object_shape(CHUNK)
    pool = HostPool(1 << 20, alignment=256, pin=False)
    objs = []
    for _ in range(OBJECTS):
        objs.append(random_fill(pool.alloc(shape, geom.dtype)))
        if not adjacent:
            pool.alloc((256,), torch.uint8)  # not adjacent: one DMA per object
    if adjacent:
        assert all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in itertools.pairwise(objs))
    engine, _ = cpu_engine(pool, int(slot_objects * objs[0].nbytes))
    ids = torch.randperm(OBJECTS * CHUNK // BS, generator=torch.Generator().manual_seed(1))
    return fmt, geom, engine, objs, ids, shape[0] * shape[1]


def _load(engine, fmt, geom, objs, ids, lead) -> None:  # type: ignore[no-untyped-def]
    """Retrieve the objects into fresh KV with `lead`; the KV must equal the reference backend's."""
    got, want = (_engine(fmt, torch.bfloat16, 7, False, nb=12) for _ in range(2))
    plan = triton_plan.build_plan(describe(fmt, got, block_size=BS))
    engine.submit(plan, objs, ids, False, CHUNK, 0, lead=lead).wait()
    kvferry.transfer(want, objs, ids, Direction.H2D, fmt, CHUNK, backend="reference", block_size=BS)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(want), strict=True))


def _dmas_from(engine, since: int, host: int) -> int:  # type: ignore[no-untyped-def]
    """Copies the fake driver made since its `since`-th from host address `host`."""
    return sum(1 for _, _, src in engine._driver.copied[since:] if src == host)


@pytest.mark.parametrize("slot_objects", [2.5, 1.0], ids=["whole-objects", "row-slices"])
def test_a_lead_of_the_first_slice_replaces_its_dma(cpu_engine, slot_objects: float) -> None:  # type: ignore[no-untyped-def]
    fmt, geom, engine, objs, ids, rows = _case(cpu_engine, slot_objects)
    nbytes = objs[0].nbytes
    assert lead_bytes(OBJECTS, nbytes, rows, engine._retrieve.slot_bytes, None) == (
        nbytes if slot_objects > 2 else nbytes // rows * (rows // 2)
    )
    for _ in range(3):  # the ring turns: each slot in turn
        since = len(engine._driver.copied)
        lead = engine.lead(objs[0].data_ptr(), nbytes, rows, OBJECTS)
        assert lead is not None and not engine._retrieve.lock.acquire(blocking=False)  # the lane is held
        _load(engine, fmt, geom, objs, ids, lead)
        assert _dmas_from(engine, since, objs[0].data_ptr()) == 1  # the lead's DMA, not again
        assert not lead.held and engine._retrieve.lock.acquire(blocking=False)
        engine._retrieve.lock.release()


def test_a_lead_of_other_bytes_is_overwritten_by_the_first_slice(cpu_engine) -> None:  # type: ignore[no-untyped-def]
    fmt, geom, engine, objs, ids, rows = _case(cpu_engine, 2.5)
    since = len(engine._driver.copied)
    lead = engine.lead(objs[1].data_ptr(), objs[1].nbytes, rows, OBJECTS)  # not the request's first object
    assert lead is not None
    _load(engine, fmt, geom, objs, ids, lead)
    assert _dmas_from(engine, since, objs[1].data_ptr()) == 2  # the lead's, and its slice's own
    assert _dmas_from(engine, since, objs[0].data_ptr()) == 1  # the first slice's, after the lead in its slot
    assert not lead.held


def test_the_lane_is_free_after_a_lead_is_released_or_given_to_a_store(cpu_engine) -> None:  # type: ignore[no-untyped-def]
    fmt, geom, engine, objs, ids, rows = _case(cpu_engine, 2.5)
    lead = engine.lead(objs[0].data_ptr(), objs[0].nbytes, rows, OBJECTS)
    assert lead is not None
    lead.release()
    lead.release()  # twice: nothing
    _load(engine, fmt, geom, objs, ids, None)  # would wait forever on a held lane

    lead = engine.lead(objs[0].data_ptr(), objs[0].nbytes, rows, OBJECTS)
    stored = [torch.empty_like(o) for o in objs]
    pool_objs = objs  # the store writes the pool objects back from the KV they were loaded into above
    paged = _engine(fmt, torch.bfloat16, 9, False, nb=12)
    plan = triton_plan.build_plan(describe(fmt, paged, block_size=BS))
    engine.submit(plan, pool_objs, ids, True, CHUNK, 0, lead=lead).wait()
    kvferry.transfer(paged, stored, ids, Direction.D2H, fmt, CHUNK, backend="reference", block_size=BS)
    assert all(torch.equal(a, b) for a, b in zip(pool_objs, stored, strict=True))
    assert lead is not None and not lead.held
    _load(engine, fmt, geom, objs, ids, None)


def test_a_lead_of_a_slice_of_several_objects_dmas_its_first_only(cpu_engine) -> None:  # type: ignore[no-untyped-def]
    fmt, geom, engine, objs, ids, rows = _case(cpu_engine, 5.0)  # two objects fit half a slot: one slice of three
    assert lead_bytes(OBJECTS, objs[0].nbytes, rows, engine._retrieve.slot_bytes, None) == objs[0].nbytes
    since = len(engine._driver.copied)
    lead = engine.lead(objs[0].data_ptr(), objs[0].nbytes, rows, OBJECTS)
    assert lead is not None
    _load(engine, fmt, geom, objs, ids, lead)
    assert [_dmas_from(engine, since, o.data_ptr()) for o in objs] == [1, 1, 1]  # the lead's, then the others'
    assert not lead.held
    assert engine.lead(objs[0].data_ptr(), objs[0].nbytes, rows, 1) is None  # one object: not staged in slices
    assert engine._retrieve.lock.acquire(blocking=False)


def test_a_lead_spans_the_objects_of_its_slice_that_lie_back_to_back(cpu_engine) -> None:  # type: ignore[no-untyped-def]
    fmt, geom, engine, objs, ids, rows = _case(cpu_engine, 5.0, adjacent=True)  # two objects a slice: 0+1, 2
    nbytes, asked = objs[0].nbytes, []

    def following(count: int) -> list[int]:
        asked.append(count)
        return [o.data_ptr() for o in objs[1 : 1 + count]]

    since = len(engine._driver.copied)
    lead = engine.lead(objs[0].data_ptr(), nbytes, rows, OBJECTS, following)
    assert asked == [1] and lead is not None and lead.nbytes == 2 * nbytes  # the first slice's two objects, one DMA
    _load(engine, fmt, geom, objs, ids, lead)
    assert [_dmas_from(engine, since, o.data_ptr()) for o in objs] == [1, 0, 1]  # the lead's covers objects 0 and 1
    assert not lead.held


def test_a_lead_stops_at_an_object_that_is_not_next_in_memory(cpu_engine) -> None:  # type: ignore[no-untyped-def]
    fmt, geom, engine, objs, ids, rows = _case(cpu_engine, 5.0)  # scattered
    since = len(engine._driver.copied)
    lead = engine.lead(objs[0].data_ptr(), objs[0].nbytes, rows, OBJECTS, lambda count: [objs[1].data_ptr()])
    assert lead is not None and lead.nbytes == objs[0].nbytes
    _load(engine, fmt, geom, objs, ids, lead)
    assert [_dmas_from(engine, since, o.data_ptr()) for o in objs] == [1, 1, 1]


def test_a_lead_longer_than_the_request_s_first_parts_is_redone(cpu_engine) -> None:  # type: ignore[no-untyped-def]
    """A lead of objects 0 and 1 for a request whose first slice is object 0 and another: nothing of it is used."""
    fmt, _geom, engine, objs, ids, rows = _case(cpu_engine, 5.0, adjacent=True)
    lead = engine.lead(objs[0].data_ptr(), objs[0].nbytes, rows, OBJECTS, lambda count: [objs[1].data_ptr()])
    assert lead is not None and lead.nbytes == 2 * objs[0].nbytes
    since = len(engine._driver.copied)
    order = [objs[0], objs[2], objs[1]]  # the first slice: objects 0 and 2
    got, want = (_engine(fmt, torch.bfloat16, 7, False, nb=12) for _ in range(2))
    plan = triton_plan.build_plan(describe(fmt, got, block_size=BS))
    engine.submit(plan, order, ids, False, CHUNK, 0, lead=lead).wait()
    kvferry.transfer(want, order, ids, Direction.H2D, fmt, CHUNK, backend="reference", block_size=BS)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(got), engine_bytes(want), strict=True))
    assert _dmas_from(engine, since, objs[0].data_ptr()) == 1  # its own DMA again, after the unused lead
    assert not lead.held
