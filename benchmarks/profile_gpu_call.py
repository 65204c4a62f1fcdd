"""Where the CPU time of one GPU transfer call goes (run on the GPU machine; prints microseconds per piece)."""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.kernels import triton_copy
from kvferry.memory import HostPool
from kvferry.transfer.api import _plans, check_request
from kvferry.transfer.gpu_engine import TransferEngine


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
    pieces = {
        "check_request": lambda: check_request(geom, objs, ids, Direction.D2H, 256, 0),
        "torch.cuda.stream ctx": lambda: _ctx(torch.cuda.stream(s)),
        "event record": lambda: ev.record(s),
        "event create+record": lambda: torch.cuda.Event().record(s),
        "stream wait_event": lambda: s.wait_event(ev),
        "pin_memory+to(cuda) 64 ints": lambda: meta.pin_memory().to("cuda", non_blocking=True),
        "torch.cuda.device ctx": lambda: _ctx(torch.cuda.device(0)),
        "triton launch (1 chunk)": lambda: triton_copy.launch(plan, staging, table, dev_ids, True, 256, 0, 256),
        "engine.submit staged": lambda: engine.submit(plan, objs, ids_t, True, 256, 0, "staged"),
        "engine.submit zero_copy": lambda: engine.submit(plan, objs, ids_t, True, 256, 0, "zero_copy"),
        "transfer_async (auto)": lambda: kvferry.transfer_async(paged, objs, ids, Direction.D2H, fmt, geometry=geom),
    }
    torch.cuda.set_stream(torch.cuda.default_stream())
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
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        kvferry.transfer_async(
            big, bobjs, bids, Direction.D2H, fmt, geometry=bgeom, engine=engine, mode="staged"
        ).wait()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
