"""Question: where does the CPU time of one GPU transfer call go (each driver call, launch, check and the engine's
submit; a stopwatch through the stages of one call; a profile)?

Answer (2026-11-29, H200 #7, engine v7): one llama3-8b chunk's store: validation done 23 us after the call, `submit`
entered 35, metadata uploaded 58, first launch 85, return 136, bytes moved 722; on engine v5 a whole call was
57 us of CPU, `submit` 50, one kernel launch 9.7 (docs/benchmark_log.md, 2026-11-29).

Run on the GPU machine (prints microseconds per piece):
    PYTHONPATH=src python3 benchmarks/experiments/profile_gpu_call.py
"""

from __future__ import annotations

import cProfile
import logging
import pstats
import time

import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.kernels import triton_copy
from kvferry.kernels.cuda_driver import driver
from kvferry.memory import HostPool
from kvferry.transfer import check_request
from kvferry.transfer.api import _plans
from kvferry.transfer.gpu_engine import TransferEngine
from kvferry.transfer.lane import Lane


def us(fn, n: int = 300) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def _ctx(manager) -> None:  # type: ignore[no-untyped-def]
    with manager:
        pass


def main() -> None:
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["qwen2.5-0.5b"], 1024, 16, device="cuda")
    geom = describe(fmt, paged)
    pool = HostPool(1 << 30)
    objs = [pool.alloc(geom.object_shape(256), torch.bfloat16)]
    ids = torch.randperm(1024)[:16]
    engine = TransferEngine("cuda")
    plan = _plans.triton(geom)
    ids_t = check_request(geom, objs, ids, Direction.D2H, 256, 0)
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    meta = torch.arange(64)
    staging = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    table = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
    dev_ids = ids_t.cuda()
    drv = driver()
    raw_event = drv.event()
    host4k = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    raw_stream = s.cuda_stream
    context = drv.current_context()
    pieces = {
        "driver: event record (ctypes)": lambda: drv.record(raw_event, raw_stream),
        "driver: stream wait (ctypes)": lambda: drv.wait(raw_stream, raw_event, 0),
        "driver: 4 KiB D2H memcpy enqueue": lambda: drv.dtoh(host4k.data_ptr(), staging.data_ptr(), 4096, raw_stream),
        "driver: context check": lambda: drv.current_context() == context,
        "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "check_request": lambda: check_request(geom, objs, ids, Direction.D2H, 256, 0),
        "torch.cuda.stream ctx": lambda: _ctx(torch.cuda.stream(s)),
        "event record": lambda: ev.record(s),
        "event create+record": lambda: torch.cuda.Event().record(s),
        "stream wait_event": lambda: s.wait_event(ev),
        "pin_memory+to(cuda) 64 ints": lambda: meta.pin_memory().to("cuda", non_blocking=True),
        "torch.cuda.device ctx": lambda: _ctx(torch.cuda.device(0)),
        "triton launch (1 chunk)": lambda: triton_copy.launch(plan, staging, table, dev_ids, True, 256, 0, 256),
        "triton launch_raw (1 chunk)": lambda: triton_copy.launch_raw(
            plan,
            raw_stream,
            staging.data_ptr(),
            table.data_ptr(),
            table.data_ptr() + 8,
            dev_ids.data_ptr(),
            True,
            256,
            0,
            256,
        ),
        "engine.submit staged": lambda: engine.submit(plan, objs, ids_t, True, 256, 0, "staged"),
        "engine.submit zero_copy": lambda: engine.submit(plan, objs, ids_t, True, 256, 0, "zero_copy"),
        "transfer_async (auto)": lambda: kvferry.transfer_async(paged, objs, ids, Direction.D2H, fmt, geometry=geom),
    }
    torch.cuda.set_stream(torch.cuda.default_stream())
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kvferry.kernels.direct_launch").setLevel(logging.DEBUG)
    triton_copy.launch(plan, staging, table, dev_ids, True, 256, 0, 256)
    for key, launcher in plan.compiled.items():
        print(f"launcher {key}: {type(launcher.launch).__name__}", flush=True)
    for name, fn in pieces.items():
        print(f"{name:32s} {us(fn):8.1f} us", flush=True)
    print("objects pinned:", objs[0].is_pinned(), "pool pinned:", pool.is_pinned, flush=True)
    # The staged path on one llama3-8b chunk (32 MiB): CPU time per call, waited between calls.
    big = make_paged(fmt, MODELS["llama3-8b"], 256, 16, device="cuda")
    bgeom = describe(fmt, big)
    bobjs = [pool.alloc(bgeom.object_shape(256), torch.bfloat16)]
    bids = torch.randperm(256)[:16]
    for mode in ("staged", "zero_copy"):
        times = []
        for _ in range(30):
            t = time.perf_counter()
            h = kvferry.transfer_async(big, bobjs, bids, Direction.D2H, fmt, geometry=bgeom, engine=engine, mode=mode)
            times.append((time.perf_counter() - t) * 1e6)
            h.wait()
        print(f"llama one chunk {mode}: CPU per call {sorted(times)[15]:.0f} us", flush=True)
    # 32 qwen chunks (96 MiB) scattered in the pool: CPU time of the call, and the call to completion
    qobjs = [pool.alloc(geom.object_shape(256), torch.bfloat16) for _ in range(32)]
    qids = torch.randperm(1024)[:512]
    for mode in ("staged", "zero_copy"):
        enq, wall = [], []
        for _ in range(20):
            t = time.perf_counter()
            h = kvferry.transfer_async(paged, qobjs, qids, Direction.D2H, fmt, geometry=geom, engine=engine, mode=mode)
            enq.append((time.perf_counter() - t) * 1e6)
            h.wait()
            wall.append((time.perf_counter() - t) * 1e6)
        print(f"qwen 32 chunks {mode}: CPU per call {sorted(enq)[10]:.0f} us, wall {sorted(wall)[10]:.0f} us")
    stages(big, bobjs, bids, fmt, bgeom, engine)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        kvferry.transfer_async(
            big, bobjs, bids, Direction.D2H, fmt, geometry=bgeom, engine=engine, mode="staged"
        ).wait()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def stages(paged, objs, ids, fmt, geom, engine) -> None:  # type: ignore[no-untyped-def]
    """Wall-clock stopwatch through one transfer_async call (no profiler): when each stage ends, from the call."""
    import importlib

    api = importlib.import_module("kvferry.transfer.api")  # `kvferry.transfer` is also the function's name
    gpu_engine = importlib.import_module("kvferry.transfer.gpu_engine")

    marks: list[tuple[str, float]] = []

    def timed(module, name: str) -> None:  # type: ignore[no-untyped-def]
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = fn(*args, **kwargs)
            marks.append((name, time.perf_counter()))
            return out

        setattr(module, name, wrapper)

    for module, name in ((api, "check"), (api, "_backend"), (triton_copy, "launch_raw")):
        timed(module, name)
    orig_upload = Lane.upload

    def upload(self, *args):  # type: ignore[no-untyped-def]
        out = orig_upload(self, *args)
        marks.append(("upload", time.perf_counter()))
        return out

    Lane.upload = upload  # type: ignore[method-assign]
    orig_submit = gpu_engine.TransferEngine.submit

    def submit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        marks.append(("submit starts", time.perf_counter()))
        return orig_submit(self, *args, **kwargs)

    gpu_engine.TransferEngine.submit = submit  # type: ignore[method-assign]
    for direction in (Direction.D2H, Direction.H2D):
        runs: dict[str, list[float]] = {}
        for _ in range(60):
            marks.clear()
            t0 = time.perf_counter()
            h = kvferry.transfer_async(paged, objs, ids, direction, fmt, geometry=geom, engine=engine, mode="staged")
            marks.append(("return", time.perf_counter()))
            h.wait()
            marks.append(("done", time.perf_counter()))
            seen: dict[str, int] = {}
            for name, t in marks:
                seen[name] = seen.get(name, 0) + 1
                runs.setdefault(f"{name}#{seen[name]}", []).append((t - t0) * 1e6)
        order = sorted(runs, key=lambda k: sorted(runs[k])[len(runs[k]) // 2])
        print(f"stages of transfer_async, llama one chunk, {direction.name} (median us from the call):", flush=True)
        for key in order:
            print(f"    {key:18s} {sorted(runs[key])[len(runs[key]) // 2]:8.1f}", flush=True)
    Lane.upload = orig_upload  # type: ignore[method-assign]
    gpu_engine.TransferEngine.submit = orig_submit  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
