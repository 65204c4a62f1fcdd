"""Question: how close to a memcpy can one chunk's call-to-completion get from Python at all, with the transfer's
kernel and nothing else on the way (its tables written once, every per-call check and lookup gone)?

Answer (2026-12-01, H200 #40-#42, store / retrieve): qwen2.5-0.5b (3 MiB) the call 0.52-0.62 / 0.52-0.61, `submit`
0.68-0.75 / 0.67-0.74, the zero-copy kernel alone on the caller's stream 0.81-0.83 / 0.75-0.78, gather + DMA by hand
0.82-0.85 / 0.90-0.92; llama3-8b (32 MiB) 0.82-0.90 / 0.84-0.91, 0.87-0.91 / 0.85-0.89, 0.90-0.92 / 0.88-0.89,
0.935-0.946 / 0.958-0.968. A 3 MiB store stays under 0.90 with nothing but its launch (docs/benchmark_log.md).

Each row times one chunk (format 1, scattered blocks, one pool object) from the Python call to the bytes having
moved, alternating with the same-run pinned memcpy (torch `copy_` + synchronize), medians over --reps:

- `api`: `kvferry.transfer_async(..., geometry=)` + `wait()` (what the bench's one-chunk rows time), in the mode
  `auto` picks and forced zero-copy;
- `submit`: `TransferEngine.submit` with the request checked once beforehand (no validation per call);
- `floor, ordered`: the zero-copy kernel launched by hand, ordered after the caller's stream as kvferry orders every
  request (record an event on the caller's stream, a lane stream waits for it, launch, record, synchronize the
  event): four driver calls and the launch's argument packing;
- `floor, on the caller's stream`: the launch alone on the caller's stream, then `torch.cuda.synchronize()` (the
  memcpy's own sync): the least any Python caller of this kernel can do;
- `floor, staged on the caller's stream`: the gather into a device buffer and one DMA of it (a retrieve: the DMA,
  then the scatter), both on the caller's stream, then the same sync: the staged path's least.

Also the CPU time of each variant's enqueue (call to return, before the wait). Run on the GPU machine:

    PYTHONPATH=src:/tmp/site python3 benchmarks/experiments/one_chunk_floor.py [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import kvferry
from kvferry import Direction
from kvferry.bench.gpu_transfer_bench import F, Setup, memcpy
from kvferry.kernels import triton_copy
from kvferry.kernels.cuda_driver import driver
from kvferry.transfer.api import _plans
from kvferry.transfer.gpu_engine import TransferEngine
from kvferry.transfer.request import check


def timed(fn: Callable[[], None], ceiling: Callable[[], None], reps: int) -> tuple[float, float]:
    ours: list[float] = []
    ceil: list[float] = []
    for _ in range(reps):
        for f, out in ((fn, ours), (ceiling, ceil)):
            t = time.perf_counter()
            f()
            out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ours), statistics.median(ceil)


def enqueue_us(enqueue: Callable[[], Callable[[], None]], reps: int) -> float:
    """Median CPU time of `enqueue()` (which returns its wait)."""
    spent = []
    for _ in range(reps):
        t = time.perf_counter()
        wait = enqueue()
        spent.append((time.perf_counter() - t) * 1e6)
        wait()
    return statistics.median(spent)


def variants(s: Setup, d: Direction, engine: TransferEngine) -> dict[str, Callable[[], Callable[[], None]]]:
    """Each variant's enqueue, returning the wait that completes it."""
    to_objects = d is Direction.D2H
    plan = _plans.triton(s.geom)
    objs = s.objects
    checked = check(s.geom, objs, s.ids, d, s.chunk, 0)
    drv = driver()
    ptr = objs[0].data_ptr()
    n_ids = len(s.ids)
    tables = torch.tensor([*s.ids.tolist(), 0, s.chunk], dtype=torch.int64).pin_memory()  # ids, offsets, caps
    meta = tables.data_ptr()
    off, cap = meta + n_ids * 8, meta + (n_ids + 1) * 8
    rows = n_ids * plan.bs
    dev_tables = tables.cuda()
    dmeta = dev_tables.data_ptr()
    staging = torch.empty(s.nbytes, dtype=torch.uint8, device="cuda")
    lane_stream = torch.cuda.Stream(priority=-1).cuda_stream
    start, done = drv.event(), drv.event()

    def api(mode: str | None) -> Callable[[], Callable[[], None]]:
        return lambda: (
            kvferry.transfer_async(
                s.paged, objs, s.ids, d, s.fmt, s.chunk, geometry=s.geom, engine=engine, mode=mode
            ).wait
        )

    def submit() -> Callable[[], None]:
        return engine.submit(plan, objs, checked, to_objects, s.chunk, 0, "zero_copy").wait

    def ordered() -> Callable[[], None]:
        caller = torch._C._cuda_getCurrentRawStream(s.geom.device.index)
        drv.record(start, caller)
        drv.wait(lane_stream, start, 0)
        triton_copy.launch_raw(plan, lane_stream, ptr, off, cap, meta, to_objects, s.chunk, 0, rows)
        drv.record(done, lane_stream)
        return lambda: drv.synchronize(done)

    def direct() -> Callable[[], None]:
        caller = torch._C._cuda_getCurrentRawStream(s.geom.device.index)
        triton_copy.launch_raw(plan, caller, ptr, off, cap, meta, to_objects, s.chunk, 0, rows)
        return torch.cuda.synchronize

    def staged() -> Callable[[], None]:
        caller = torch._C._cuda_getCurrentRawStream(s.geom.device.index)
        stage = staging.data_ptr()
        doff, dcap = dmeta + n_ids * 8, dmeta + (n_ids + 1) * 8
        if not to_objects:
            drv.htod(stage, ptr, s.nbytes, caller)
        triton_copy.launch_raw(plan, caller, stage, doff, dcap, dmeta, to_objects, s.chunk, 0, rows)
        if to_objects:
            drv.dtoh(ptr, stage, s.nbytes, caller)
        return torch.cuda.synchronize

    return {
        "api, auto": api(None),
        "api, zero-copy": api("zero_copy"),
        "submit, zero-copy": submit,
        "floor, ordered": ordered,
        "floor, on the caller's stream": direct,
        "floor, staged on the caller's stream": staged,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    engine = TransferEngine("cuda")
    print(f"{torch.cuda.get_device_name()}; ratio = memcpy p50 / variant p50; enqueue = CPU us to return")
    for model in ("qwen2.5-0.5b", "llama3-8b"):
        s = Setup(model, F.NL_X_TWO_NB_BS_NH_HS, 1)
        for d in (Direction.D2H, Direction.H2D):
            ceiling = memcpy(s.nbytes, d is Direction.D2H)
            for name, enqueue in variants(s, d, engine).items():
                for _ in range(20):  # warm: compile, caches
                    enqueue()()
                ours, ceil = timed(lambda e=enqueue: e()(), ceiling, args.reps)
                cpu = enqueue_us(enqueue, args.reps // 2)
                print(f"{model:13s} {d.name} {name:30s} p50 {ours:7.1f} us  memcpy {ceil:7.1f} us  "
                      f"ratio {ceil / ours:.3f}  enqueue {cpu:6.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
