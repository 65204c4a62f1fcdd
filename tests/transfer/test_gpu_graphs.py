"""One-object requests replayed as CUDA graphs (`kvferry.transfer.graphed`): every format, both directions, many
requests in flight through one graph re-aimed at different objects and ids, ordering after the caller's stream."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe, layout_of
from kvferry.formats.synthetic import MODELS, ModelDims, make_paged, random_fill
from kvferry.kernels import triton_copy
from kvferry.memory import HostPool
from kvferry.transfer.api import _plans
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.gpu_engine import TransferEngine
from tests.conftest import kv_dtype_for, leaves
from tests.transfer.test_gpu import _to_cpu

pytestmark = pytest.mark.gpu
F = EngineKVFormat
POISON = 0x5A


@pytest.fixture(scope="module")
def pool() -> HostPool:
    return HostPool(1 << 30)


def _paged(fmt: F, nb: int = 128):  # type: ignore[no-untyped-def]
    """An engine KV cache in `fmt` at a small model's shape (deepseek's for the MLA formats), and its block size."""
    mla = layout_of(fmt).is_mla
    dims = MODELS["deepseek-v3-mla"] if mla else MODELS["qwen2.5-0.5b"]
    if fmt == F.NL_X_NB_BSV_BSS:
        dims = ModelDims(nl=61, nh=1, hs=132)
    bs = 64 if mla else 16
    return make_paged(fmt, dims, nb, bs, kv_dtype_for(fmt, torch.bfloat16), device="cuda"), bs


def _poisoned(pool: HostPool, shape, dtype, n: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    objs = [pool.alloc(shape, dtype) for _ in range(n)]
    for o in objs:
        o.view(torch.uint8).fill_(POISON)
    return objs


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_one_object_requests_in_flight_through_one_graph(fmt: F, pool: HostPool) -> None:
    """Six stores, then six retrieves, of one whole object each with its own ids and object, all enqueued before
    any is waited for: one graph per direction, re-aimed per request, moves what the torch backend moves."""
    paged, bs = _paged(fmt)
    geom = describe(fmt, paged, block_size=bs)
    chunk = 256
    per = chunk // bs
    engine = TransferEngine("cuda")
    plan = _plans.triton(geom)
    plan.graphs.clear()
    gen = torch.Generator().manual_seed(int(fmt))
    id_sets = [torch.randperm(128, generator=gen)[:per] for _ in range(6)]
    stored = _poisoned(pool, geom.object_shape(chunk), geom.dtype, 6)
    handles = [
        kvferry.transfer_async(paged, [o], ids, Direction.D2H, fmt, chunk, geometry=geom, engine=engine)
        for o, ids in zip(stored, id_sets, strict=True)
    ]
    for h in handles:
        h.wait()
    assert {h.mode for h in handles} == {"staged"}
    assert len(plan.graphs) == 1, "the six stores share one captured graph"
    for o, ids in zip(stored, id_sets, strict=True):
        want = torch.empty(o.shape, dtype=o.dtype, device="cuda")
        want.view(torch.uint8).fill_(POISON)
        kvferry.transfer(paged, [want], ids, Direction.D2H, fmt, chunk, backend="torch", geometry=geom)
        assert torch.equal(o.cuda().view(torch.uint8), want.view(torch.uint8))

    sources = _poisoned(pool, geom.object_shape(chunk), geom.dtype, 6)
    for o in sources:
        random_fill(o)
    target, _ = _paged(fmt)
    target_geom = describe(fmt, target, block_size=bs)
    want = _to_cpu(target)
    # distinct blocks per request: a later retrieve must not overwrite an earlier one for the check to see each
    blocks = torch.randperm(128, generator=gen)[: 6 * per].view(6, per)
    handles = [
        kvferry.transfer_async(target, [o], ids, Direction.H2D, fmt, chunk, geometry=target_geom, engine=engine)
        for o, ids in zip(sources, blocks, strict=True)
    ]
    for h in handles:
        h.wait()
    assert len(_plans.triton(target_geom).graphs) == 1
    for o, ids in zip(sources, blocks, strict=True):
        kvferry.transfer(want, [o], ids, Direction.H2D, fmt, chunk, backend="torch", block_size=bs)
    got = [t.cpu().contiguous().view(torch.uint8) for t in leaves(target)]
    assert all(torch.equal(a, b.contiguous().view(torch.uint8)) for a, b in zip(got, leaves(want), strict=True))
    for o in stored + sources:
        pool.free(o)


def test_graphed_and_staged_requests_share_the_first_slot(pool: HostPool) -> None:
    """Graphs stage in their lane's first slot, which staged requests use too: one-object stores (graphs) and
    three-object stores (the pipeline, through every slot) by turns, all in flight at once, each what torch moves."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 256, 16, device="cuda")
    geom = describe(fmt, paged, block_size=16)
    engine = TransferEngine("cuda", EngineConfig(slot_bytes=8 << 20, slice_bytes=4 << 20))
    gen = torch.Generator().manual_seed(7)
    requests = []
    for i in range(8):
        n = 1 if i % 2 == 0 else 3
        objs = _poisoned(pool, geom.object_shape(256), geom.dtype, n)
        ids = torch.randperm(256, generator=gen)[: 16 * n]
        handle = kvferry.transfer_async(paged, objs, ids, Direction.D2H, fmt, geometry=geom, engine=engine)
        requests.append((objs, ids, handle))
    for objs, ids, handle in requests:
        handle.wait()
        want = [torch.empty(o.shape, dtype=o.dtype, device="cuda") for o in objs]
        kvferry.transfer(paged, want, ids, Direction.D2H, fmt, backend="torch", geometry=geom)
        for got, expected in zip(objs, want, strict=True):
            assert torch.equal(got.cuda().view(torch.uint8), expected.view(torch.uint8))
        for o in objs:
            pool.free(o)
    assert len(_plans.triton(geom).graphs) == 1


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "llama3-8b"])
@pytest.mark.parametrize("tokens", [256, 128])
def test_graphed_round_trip_matches_the_staged_path(model: str, tokens: int, pool: HostPool) -> None:
    """A whole object (a full chunk, or a smaller last one) stored and retrieved by graph equals the same request
    through the staged pipeline with graphs off; the two, and the zero-copy kernel, agree byte for byte."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS[model], 64, 16, device="cuda")
    geom = describe(fmt, paged, block_size=16)
    shape = (*geom.object_shape(256)[:2], tokens, geom.object_shape(256)[3])
    ids = torch.randperm(64)[: tokens // 16]
    outs = {}
    for name, config in (("graph", EngineConfig()), ("staged", EngineConfig(mode="staged", graph_max_bytes=0)),
                         ("zero_copy", EngineConfig(mode="zero_copy"))):  # fmt: skip
        engine = TransferEngine("cuda", config)
        [obj] = _poisoned(pool, shape, geom.dtype, 1)
        kvferry.transfer_async(paged, [obj], ids, Direction.D2H, fmt, geometry=geom, engine=engine).wait()
        outs[name] = obj
    assert torch.equal(outs["graph"].view(torch.uint8), outs["staged"].view(torch.uint8))
    assert torch.equal(outs["graph"].view(torch.uint8), outs["zero_copy"].view(torch.uint8))
    random_fill(outs["graph"])
    target = make_paged(fmt, MODELS[model], 64, 16, device="cuda")
    before = [t.clone() for t in target]
    kvferry.transfer_async(target, [outs["graph"]], ids, Direction.H2D, fmt, geometry=describe(fmt, target, 16),
                           engine=TransferEngine("cuda")).wait()  # fmt: skip
    want = [t.clone() for t in before]
    kvferry.transfer(want, [outs["graph"].cuda()], ids, Direction.H2D, fmt, backend="torch", block_size=16)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(target, want, strict=True))
    for o in outs.values():
        pool.free(o)


def test_graphed_requests_wait_for_the_callers_stream(pool: HostPool) -> None:
    """A graphed store queues behind the model's stream and sees what it wrote; a graphed retrieve does not land
    before the model is done with the blocks."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 64, 16, device="cuda")
    geom = describe(fmt, paged, block_size=16)
    engine = TransferEngine("cuda")
    [obj] = _poisoned(pool, geom.object_shape(256), geom.dtype, 1)
    ids = list(range(16))
    kvferry.transfer_async(paged, [obj], ids, Direction.D2H, fmt, geometry=geom, engine=engine).wait()  # captured
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(500_000_000)
        for t in paged:
            t.fill_(1.5)
        handle = kvferry.transfer_async(paged, [obj], ids, Direction.D2H, fmt, geometry=geom, engine=engine)
    assert not handle.done()
    handle.wait()
    assert bool((obj == 1.5).all())

    obj.fill_(-2.0)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(500_000_000)
        for t in paged:
            t.fill_(3.0)  # the model's last write to the blocks; the retrieve must land after it
        handle = kvferry.transfer_async(paged, [obj], ids, Direction.H2D, fmt, geometry=geom, engine=engine)
    handle.wait()
    torch.cuda.synchronize()
    assert all(bool((t[:, :16] == -2.0).all()) for t in paged)
    pool.free(obj)


def test_a_first_graphed_request_behind_a_busy_stream_does_not_block(pool: HostPool) -> None:
    """The capture of a shape's graph happens on the first such request; the caller's stream may be queued behind
    a second of the model's work, and neither the capture nor the request waits for it on the CPU."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 64, 16, device="cuda")
    geom = describe(fmt, paged, block_size=16)
    engine = TransferEngine("cuda")
    [obj] = _poisoned(pool, geom.object_shape(256), geom.dtype, 1)
    triton_copy.compile_all(_plans.triton(geom))  # compiling is not what this measures
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(6_000_000_000)  # ~3 s of "model compute" (longer under other test workers' load)
        for t in paged:
            t.fill_(0.5)
        t0 = time.perf_counter()
        handle = kvferry.transfer_async(paged, [obj], list(range(16)), Direction.D2H, fmt, geometry=geom,
                                        engine=engine)  # fmt: skip
        enqueue_s = time.perf_counter() - t0
    assert enqueue_s < 1.0, f"a first graphed request behind a busy stream took {enqueue_s * 1e3:.0f} ms to enqueue"
    assert not handle.done(), f"done before the model's stream (enqueued in {enqueue_s * 1e3:.0f} ms)"
    handle.wait()
    assert bool((obj == 0.5).all())
    pool.free(obj)


def test_a_dropped_engines_graphs_are_let_go(pool: HostPool) -> None:
    """Graphs live on the plan, keyed by their engine's lane: a dropped engine's graphs (and their staging) go at
    the next capture for that plan."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 64, 16, device="cuda")
    geom = describe(fmt, paged, block_size=16)
    plan = _plans.triton(geom)
    plan.graphs.clear()
    [obj] = _poisoned(pool, geom.object_shape(256), geom.dtype, 1)
    engine = TransferEngine("cuda")
    kvferry.transfer_async(paged, [obj], list(range(16)), Direction.D2H, fmt, geometry=geom, engine=engine).wait()
    assert len(plan.graphs) == 1
    del engine
    gc.collect()
    fresh = TransferEngine("cuda")
    kvferry.transfer_async(paged, [obj], list(range(16)), Direction.D2H, fmt, geometry=geom, engine=fresh).wait()
    assert len(plan.graphs) == 1 and all(key[0]() is not None for key in plan.graphs)
    pool.free(obj)


def test_a_refused_capture_falls_back_to_the_staged_path(
    pool: HostPool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A driver that refuses the capture (an old one, or a capture invalidated) costs nothing but the graph: the
    request moves by the staged pipeline, a warning says so once, and the engine stops trying."""
    from kvferry.cuda.driver import CudaError
    from kvferry.transfer import gpu_engine

    def refuse(*args: object, **kwargs: object) -> None:
        raise CudaError("cuStreamBeginCapture_v2 failed: CUDA_ERROR_NOT_SUPPORTED (801)")

    monkeypatch.setattr(gpu_engine, "ObjectGraph", refuse)
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 64, 16, device="cuda")
    geom = describe(fmt, paged, block_size=16)
    engine = TransferEngine("cuda")
    objs = _poisoned(pool, geom.object_shape(256), geom.dtype, 2)
    ids = torch.randperm(64)[:16]
    for obj in objs:
        kvferry.transfer_async(paged, [obj], ids, Direction.D2H, fmt, geometry=geom, engine=engine).wait()
    want = torch.empty(objs[0].shape, dtype=geom.dtype, device="cuda")
    kvferry.transfer(paged, [want], ids, Direction.D2H, fmt, backend="torch", geometry=geom)
    assert all(torch.equal(o.cuda(), want) for o in objs)
    assert [r.message for r in caplog.records if "capture" in r.message] == [
        "CUDA graph capture failed (cuStreamBeginCapture_v2 failed: CUDA_ERROR_NOT_SUPPORTED (801)): one-object "
        "requests take the staged path"
    ]
    for o in objs:
        pool.free(o)
