"""GPU data path (run on the device machine: PYTHONPATH=src python3 -m pytest -m gpu tests/transfer)."""

from __future__ import annotations

import time

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.cuda.mps import mps_running
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, ModelDims, make_paged, random_fill
from kvferry.kernels.page_dma import page_plan
from kvferry.memory import HostPool
from kvferry.transfer import forget_plans
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.gpu_engine import TransferEngine
from tests.conftest import kv_dtype_for, leaves

pytestmark = pytest.mark.gpu
F = EngineKVFormat


def _to_cpu(paged, spans=None):  # type: ignore[no-untyped-def]
    """The engine's tensors on the CPU, padding and sharing kept: each storage is copied once (layers are often
    views of one buffer: copying it per layer took 70 GB of host memory for deepseek's 122 planes x layers)."""
    spans = {} if spans is None else spans
    if isinstance(paged, torch.Tensor):
        key = (paged.untyped_storage().data_ptr(), paged.dtype)
        if key not in spans:
            n = paged.untyped_storage().nbytes() // paged.element_size()
            spans[key] = paged.as_strided((n,), (1,), 0).cpu()
        return spans[key].as_strided(paged.shape, paged.stride(), paged.storage_offset())
    return [_to_cpu(p, spans) for p in paged]


def _objects(pool: HostPool, shape, dtype, n: int, last_tokens: int | None = None, spread: bool = True):  # type: ignore[no-untyped-def]
    objs, gaps = [], []
    for i in range(n):
        s = shape if (i < n - 1 or last_tokens is None) else (*shape[:2], last_tokens, shape[3])
        objs.append(pool.alloc(s, dtype))
        if spread:  # scatter objects in the pool
            gaps.append(pool.alloc((4096 * (i % 3 + 1),), torch.uint8))
    for o in objs:
        o.view(torch.uint8).fill_(0x5A)
    for g in gaps:
        pool.free(g)
    return objs


CASES = [
    ("llama3-8b", F.NL_X_TWO_NB_BS_NH_HS, 16),
    ("qwen2.5-0.5b", F.NL_X_TWO_NB_BS_NH_HS, 16),
    ("deepseek-v3-mla", F.NL_X_NB_BS_HS, 64),
]


@pytest.fixture(scope="module")
def pool() -> HostPool:
    """One pinned pool for the module: pinning a fresh GiB per test made the file outlast its time limit."""
    return HostPool(1 << 30)


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
@pytest.mark.parametrize("mode", ["staged", "zero_copy", "page_dma"])
def test_every_format_realistic_shape(fmt: F, mode: str, pool: HostPool) -> None:
    dims = MODELS["deepseek-v3-mla"] if describe_is_mla(fmt) else MODELS["llama3-8b"]
    bs = 64 if describe_is_mla(fmt) else 16
    dtype = kv_dtype_for(fmt, torch.bfloat16)
    if fmt == F.NL_X_NB_BSV_BSS:
        dims = ModelDims(nl=61, nh=1, hs=132)
    paged = make_paged(fmt, dims, 64, bs, dtype, device="cuda", block_padding=128 if fmt == F.NL_X_NB_BS_HS else 0)
    geom = describe(fmt, paged, block_size=bs)
    if mode == "page_dma" and page_plan(geom) is None:
        pytest.skip(f"{fmt.name}'s pages are not runs of object rows")
    chunk = 256
    ids = torch.randperm(64)[: 3 * chunk // bs - 2]  # 3 objects, the last partial
    shape = geom.object_shape(chunk)
    last = chunk - 2 * bs
    engine = TransferEngine("cuda", EngineConfig(mode=mode))
    objs = _objects(pool, shape, dtype, 3, last)
    skip = 3
    kvferry.transfer_async(paged, objs, ids, Direction.D2H, fmt, chunk, skip, block_size=bs, engine=engine).wait()
    cpu = _to_cpu(paged)
    want = [torch.full_like(o, 0).view(torch.uint8).fill_(0x5A).view(dtype) for o in objs]
    kvferry.transfer(cpu, want, ids, Direction.D2H, fmt, chunk, skip, backend="torch", block_size=bs)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, want, strict=True))

    for o in objs:
        random_fill(o)
    target = make_paged(fmt, dims, 64, bs, dtype, device="cuda", block_padding=128 if fmt == F.NL_X_NB_BS_HS else 0)
    target_cpu = _to_cpu(target)
    kvferry.transfer_async(target, objs, ids, Direction.H2D, fmt, chunk, skip, block_size=bs, engine=engine).wait()
    kvferry.transfer(target_cpu, objs, ids, Direction.H2D, fmt, chunk, skip, backend="torch", block_size=bs)
    got = [t.cpu().contiguous().view(torch.uint8) for t in leaves(target)]
    want_kv = [t.contiguous().view(torch.uint8) for t in leaves(target_cpu)]
    assert all(torch.equal(a, b) for a, b in zip(got, want_kv, strict=True))
    for o in objs:
        pool.free(o)


def describe_is_mla(fmt: F) -> bool:
    from kvferry.formats import layout_of

    return layout_of(fmt).is_mla


@pytest.mark.parametrize(("model", "fmt", "bs"), CASES)
def test_ring_reuse_and_concurrent_directions(model: str, fmt: F, bs: int, pool: HostPool) -> None:
    """Many requests through one small ring, random sizes and skips, a store and a retrieve in flight at once.

    Expected values come from the torch backend on the GPU (itself checked against the reference on CPU)."""
    dims = MODELS[model]
    paged = make_paged(fmt, dims, 256, bs, device="cuda")
    other = make_paged(fmt, dims, 256, bs, device="cuda")
    geom = describe(fmt, paged)
    engine = TransferEngine("cuda", EngineConfig(slot_bytes=48 << 20, mode="staged"))
    gen = torch.Generator().manual_seed(0)
    chunk = 256
    per = chunk // bs
    for _ in range(8):
        n = int(torch.randint(1, 5, (1,), generator=gen))
        ids = torch.randperm(256, generator=gen)[: n * per]
        skip = int(torch.randint(0, n * per, (1,), generator=gen))
        stored = _objects(pool, geom.object_shape(chunk), geom.dtype, n)
        src = _objects(pool, geom.object_shape(chunk), geom.dtype, n)
        for o in src:
            random_fill(o)
        h1 = kvferry.transfer_async(paged, stored, ids, Direction.D2H, fmt, chunk, skip, engine=engine)
        h2 = kvferry.transfer_async(other, src, ids, Direction.H2D, fmt, chunk, skip, engine=engine)
        h1.wait()
        h2.wait()
        want = [torch.empty(o.shape, dtype=o.dtype, device="cuda") for o in stored]
        for w in want:
            w.view(torch.uint8).fill_(0x5A)  # the skipped head of `stored` must still hold this poison
        kvferry.transfer(paged, want, ids, Direction.D2H, fmt, chunk, skip, backend="torch")
        assert all(
            torch.equal(a.cuda().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(stored, want, strict=True)
        )
        back = [torch.zeros(o.shape, dtype=o.dtype, device="cuda") for o in src]
        kvferry.transfer(other, back, ids, Direction.D2H, fmt, chunk, skip, backend="torch")
        head = skip * bs
        for i, (a, b) in enumerate(zip(src, back, strict=True)):
            lo = max(0, min(a.shape[2], head - i * chunk))
            assert torch.equal(a[:, :, lo:].cuda().view(torch.uint8), b[:, :, lo:].view(torch.uint8))
        for o in stored + src:
            pool.free(o)


def test_handle_orders_after_compute_stream(pool: HostPool) -> None:
    """Requests queue behind the model's stream without blocking the CPU, more of them than the metadata ring."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["llama3-8b"], 64, 16, device="cuda")
    objs = [_objects(pool, kvferry.object_shape(fmt, paged), torch.bfloat16, 2) for _ in range(10)]
    kvferry.transfer_async(paged, objs[0], list(range(32)), Direction.D2H, fmt).wait()  # compile before timing
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of "model compute" before the KV is final
        for t in paged:
            t.fill_(1.5)
        t0 = time.perf_counter()
        handles = [kvferry.transfer_async(paged, o, list(range(32)), Direction.D2H, fmt) for o in objs]
        enqueue_s = time.perf_counter() - t0
    done = [h.done() for h in handles]
    assert enqueue_s < 0.2, f"enqueueing 10 requests behind a busy stream took {enqueue_s * 1e3:.0f} ms"
    assert not any(done), f"finished before the model's stream: {done}, enqueued in {enqueue_s * 1e3:.0f} ms"
    for h in handles:
        h.wait()
    assert all(bool((o == 1.5).all()) for pair in objs for o in pair)
    for pair in objs:
        for o in pair:
            pool.free(o)


@pytest.mark.parametrize("own_stream", [False, True], ids=["default-stream", "own-stream"])
def test_the_first_request_of_new_kv_does_not_wait_for_the_callers_queued_work(
    own_stream: bool, pool: HostPool
) -> None:
    """KV with no plan yet (new addresses: a new plan, its tables uploaded) is enqueued behind ~1 s of the caller's
    queued work without the host waiting for it, on the default stream as on a stream of the caller's own."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    warm = make_paged(fmt, MODELS["llama3-8b"], 64, 16, device="cuda")
    objs = _objects(pool, kvferry.object_shape(fmt, warm), torch.bfloat16, 2)
    kvferry.transfer(warm, objs, list(range(32)), Direction.D2H, fmt)  # the kernels compiled before timing
    for t in warm:  # and the caller's loaded, as a model's are (CUDA loads a kernel's module at its first launch)
        t.fill_(2.5)
    paged = make_paged(fmt, MODELS["llama3-8b"], 64, 16, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream() if own_stream else torch.cuda.default_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of "model compute" before the KV is final
        for t in paged:
            t.fill_(2.5)
        t0 = time.perf_counter()
        handle = kvferry.transfer_async(paged, objs, list(range(32)), Direction.D2H, fmt)
        enqueue_s = time.perf_counter() - t0
    done = handle.done()
    assert enqueue_s < 0.2, f"the first request of new KV took {enqueue_s * 1e3:.0f} ms to enqueue"
    assert not done, "finished before the caller's queued work"
    handle.wait()
    assert all(bool((o == 2.5).all()) for o in objs)
    for o in objs:
        pool.free(o)


@pytest.mark.skipif(
    mps_running(),
    reason="under CUDA MPS the new plan's upload stream may share a work queue with the caller's (docs/server.md): "
    "the upload, and the test's host with it, then waits for the queued work the test needs still pending",
)
def test_a_request_queued_behind_the_caller_reads_its_own_plan_after_the_plan_was_dropped(pool: HostPool) -> None:
    """The caller drops a plan (`forget_plans`) while a store made with it waits behind ~0.3 s of its queued work,
    and the next KV's plan uploads tables of the same size: the store still copies by its own tables. (That KV's
    layers lie in another order in its buffer, so its tables, read by the store's kernels, would move other layers.)"""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["llama3-8b"], 64, 16, device="cuda")
    geom = describe(fmt, paged)
    ids = torch.randperm(64)[:32]
    objs = _objects(pool, kvferry.object_shape(fmt, paged), torch.bfloat16, 2)
    expected = [torch.full_like(o, 7.0, device="cuda") for o in objs]  # the torch backend's objects, on the GPU
    kvferry.transfer(paged, expected, ids, Direction.D2H, fmt, backend="torch")
    kvferry.transfer(paged, objs, ids, Direction.D2H, fmt, geometry=geom)  # compiled, its plan built
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(500_000_000)
        handle = kvferry.transfer_async(paged, objs, ids, Direction.D2H, fmt, geometry=geom)
    forget_plans(geom)
    del geom
    other = make_paged(fmt, MODELS["llama3-8b"], 64, 16, device="cuda")
    other = [other[0], *other[:0:-1]]  # layer 0 first (the tables' base), the others reversed
    spare = _objects(pool, kvferry.object_shape(fmt, other), torch.bfloat16, 2)
    after = kvferry.transfer_async(other, spare, ids, Direction.D2H, fmt)  # its plan built and uploaded by now
    assert not handle.done(), "the store did not wait for the caller's queued work"
    handle.wait()
    after.wait()
    for got, want in zip(objs, expected, strict=True):
        assert torch.equal(got.cuda().view(torch.uint8), want.view(torch.uint8))
    for o in objs + spare:
        pool.free(o)


@pytest.mark.parametrize("mode", ["auto", "staged", "zero_copy", "page_dma"])
def test_a_retrieve_writes_after_the_callers_stream(mode: str, pool: HostPool) -> None:
    """A retrieve enqueued behind the model's last write of its blocks lands after it, in every mode."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["llama3-8b"], 64, 16, device="cuda")
    objs = _objects(pool, kvferry.object_shape(fmt, paged), torch.bfloat16, 2)
    for o in objs:
        random_fill(o)
    engine = TransferEngine("cuda", EngineConfig(mode=mode))
    ids = torch.randperm(64)[:32]
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of "model compute" still reading the blocks
        for t in paged:
            t.fill_(1.5)
        handle = kvferry.transfer_async(paged, objs, ids, Direction.H2D, fmt, engine=engine)
    handle.wait()
    assert handle.mode == ("staged" if mode == "auto" else mode)
    back = _objects(pool, kvferry.object_shape(fmt, paged), torch.bfloat16, 2)
    kvferry.transfer(paged, back, ids, Direction.D2H, fmt)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, back, strict=True))
    for o in objs + back:
        pool.free(o)


@pytest.mark.parametrize("to_objects", [True, False], ids=["store", "retrieve"])
def test_objects_larger_than_a_slot_move_in_row_slices(to_objects: bool, pool: HostPool) -> None:
    """A 32 MiB llama3-8b chunk through 8 MiB slots: the pipeline cuts objects into row ranges."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["llama3-8b"], 128, 16, device="cuda")
    geom = describe(fmt, paged)
    engine = TransferEngine("cuda", EngineConfig(slot_bytes=8 << 20, mode="staged"))
    ids = torch.randperm(128)[:40]  # 2 full objects + a partial one
    objs = _objects(pool, geom.object_shape(256), geom.dtype, 3, last_tokens=128)
    skip = 5
    direction = Direction.D2H if to_objects else Direction.H2D
    if to_objects:
        kvferry.transfer_async(paged, objs, ids, direction, fmt, 256, skip, engine=engine).wait()
        want = [torch.empty(o.shape, dtype=o.dtype, device="cuda") for o in objs]
        for w in want:
            w.view(torch.uint8).fill_(0x5A)
        kvferry.transfer(paged, want, ids, direction, fmt, 256, skip, backend="torch")
        assert all(
            torch.equal(a.cuda().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, want, strict=True)
        )
    else:
        for o in objs:
            random_fill(o)
        want_kv = [t.clone() for t in paged]
        kvferry.transfer(want_kv, [o.cuda() for o in objs], ids, direction, fmt, 256, skip, backend="torch")
        kvferry.transfer_async(paged, objs, ids, direction, fmt, 256, skip, engine=engine).wait()
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(paged, want_kv, strict=True))
    for o in objs:
        pool.free(o)


def test_gpu_objects_and_sync_api() -> None:
    fmt = F.NL_X_NB_TWO_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 64, 16, device="cuda")
    objs = [torch.empty(kvferry.object_shape(fmt, paged), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    ids = torch.randperm(64)[:32]
    kvferry.transfer(paged, objs, ids, Direction.D2H, fmt)
    want = [torch.empty(o.shape, dtype=o.dtype) for o in objs]
    kvferry.transfer(_to_cpu(paged), want, ids, Direction.D2H, fmt, backend="reference")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(objs, want, strict=True))


@pytest.mark.parametrize(("model", "fmt", "bs"), CASES)
@pytest.mark.parametrize("mode", ["staged", "zero_copy", "page_dma"])
def test_objects_as_one_tensor(model: str, fmt: F, bs: int, mode: str, pool: HostPool) -> None:
    """A request whose objects come as one tensor [n, *object_shape] (adjacent in the pool) moves the same bytes."""
    paged = make_paged(fmt, MODELS[model], 128, bs, device="cuda")
    geom = describe(fmt, paged, block_size=bs)
    chunk = 256
    run = pool.alloc((5, *geom.object_shape(chunk)), geom.dtype)
    run.view(torch.uint8).fill_(0x5A)
    ids = torch.randperm(128)[: 5 * chunk // bs]
    engine = TransferEngine("cuda", EngineConfig(mode=mode, slice_bytes=chunk * geom.bytes_per_token * 2))
    kvferry.transfer_async(paged, run, ids, Direction.D2H, fmt, chunk, 2, block_size=bs, engine=engine).wait()
    want = torch.empty_like(run).view(torch.uint8).fill_(0x5A).view(geom.dtype)
    kvferry.transfer(_to_cpu(paged), want, ids, Direction.D2H, fmt, chunk, 2, backend="torch", block_size=bs)
    assert torch.equal(run.view(torch.uint8), want.view(torch.uint8))

    random_fill(run)
    target = make_paged(fmt, MODELS[model], 128, bs, device="cuda")
    target_cpu = _to_cpu(target)
    kvferry.transfer_async(target, run, ids, Direction.H2D, fmt, chunk, 2, block_size=bs, engine=engine).wait()
    kvferry.transfer(target_cpu, run, ids, Direction.H2D, fmt, chunk, 2, backend="torch", block_size=bs)
    got = [t.cpu().contiguous().view(torch.uint8) for t in leaves(target)]
    assert all(torch.equal(a, b.contiguous().view(torch.uint8)) for a, b in zip(got, leaves(target_cpu), strict=True))
    pool.free(run)


@pytest.mark.parametrize("mode", ["staged", "zero_copy"])
def test_a_slice_of_the_heads_moves_its_columns_only(mode: str, pool: HostPool) -> None:
    """A tensor-parallel rank (heads 2..3 of 8) writes only its columns of whole objects, whatever mode is asked:
    a staged DMA of whole rows would overwrite the other ranks' heads, so such requests run zero-copy."""
    fmt, bs, chunk = F.NL_X_TWO_NB_BS_NH_HS, 16, 256
    dims = ModelDims(nl=4, nh=2, hs=128)
    paged = make_paged(fmt, dims, 64, bs, device="cuda")
    geom = describe(fmt, paged, block_size=bs, heads=(2, 8))
    objs = _objects(pool, geom.object_shape(chunk), geom.dtype, 2)
    ids = torch.randperm(64)[: 2 * chunk // bs]
    engine = TransferEngine("cuda", EngineConfig(mode=mode))
    handle = kvferry.transfer_async(paged, objs, ids, Direction.D2H, fmt, chunk, geometry=geom, engine=engine)
    handle.wait()
    want = [torch.empty_like(o).view(torch.uint8).fill_(0x5A).view(geom.dtype) for o in objs]
    cpu_geom = describe(fmt, _to_cpu(paged), block_size=bs, heads=(2, 8))
    kvferry.transfer(_to_cpu(paged), want, ids, Direction.D2H, fmt, chunk, backend="torch", geometry=cpu_geom)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(objs, want, strict=True))
    for o in objs:
        pool.free(o)


def test_prepare_gpu_compiles_both_directions_before_any_request() -> None:
    from kvferry.transfer.api import _plans, prepare_gpu

    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 8, 16, device="cuda")
    geom = describe(fmt, paged, 16)
    prepare_gpu(geom)
    plan = _plans.triton(geom)
    assert {(i, d, True) for i in range(len(plan.stripes)) for d in (True, False)} <= set(plan.compiled)
    with pytest.raises(ValueError, match="GPU KV"):
        prepare_gpu(describe(fmt, make_paged(fmt, MODELS["qwen2.5-0.5b"], 8, 16), 16))
