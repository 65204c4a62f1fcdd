"""Question: how close to a memcpy can one chunk's call-to-completion get from Python at all, with the transfer's
kernel and nothing else on the way (its tables written once, every per-call check and lookup gone)?

Answer (2026-12-01, H200 #40-#42, store / retrieve): qwen2.5-0.5b (3 MiB) the call 0.52-0.62 / 0.52-0.61, `submit`
0.68-0.75 / 0.67-0.74, the zero-copy kernel alone on the caller's stream 0.81-0.83 / 0.75-0.78, gather + DMA by hand
0.82-0.85 / 0.90-0.92; llama3-8b (32 MiB) 0.82-0.90 / 0.84-0.91, 0.87-0.91 / 0.85-0.89, 0.90-0.92 / 0.88-0.89,
0.935-0.946 / 0.958-0.968. A 3 MiB store stays under 0.90 with nothing but its launch. `--chunks 16` (#43):
qwen2.5-0.5b the call 0.85-0.91 / 0.82, `submit` 0.94-0.95 / 0.95, gather + one batch of DMAs by hand 0.947 /
0.947; llama3-8b 0.956 / 0.956, 0.978 / 0.986, 0.967 / 0.970 (docs/benchmark_log.md).

Graphs (2026-12-02, H200 #12-#15): the staged sequence captured once and replayed reaches qwen2.5-0.5b 0.88-0.91 /
0.93-0.95 / 0.90-0.97 (store; one, two, four row ranges) and 0.86-0.99 / 0.89-0.93 / 0.80-0.84 (retrieve), llama3-8b
0.96-0.99 and 0.96-0.98: the GPU side of one chunk reaches both goals. The engine now replays such a graph for a
one-object request (`api, auto`; `api, auto, graphs off` is the same call without): qwen2.5-0.5b 0.53-0.63 / 0.57-0.64,
llama3-8b 0.86-0.87 / 0.83-0.92; what is left is the call's own CPU time before the launch. The engine's graph
launched by hand with nothing but what a real request needs (#23, #28): qwen2.5-0.5b 0.848 / 0.799 and 0.838 / 0.846
(enqueue 11-18 us), llama3-8b 0.965 / 0.949 and 0.956 / 0.957: one 3 MiB chunk stays under 0.90 from Python even so.
A one-object retrieve without its graph (#29): 0.885-0.889 by hand, 0.776-0.810 through `submit` against the graph's
0.751-0.766, but through the public call 0.615 and 0.664 against 0.655 and 0.647: no gain the call shows.

Each row times one chunk (format 1, scattered blocks, one pool object) from the Python call to the bytes having
moved, alternating with the same-run pinned memcpy (torch `copy_` + synchronize), medians over --reps:

- `api`: `kvferry.transfer_async(..., geometry=)` + `wait()` (what the bench's one-chunk rows time), in the mode
  `auto` picks and forced zero-copy; `graphs off`: through an engine that captures none (`auto`, and staged);
- `submit`: `TransferEngine.submit` with the request checked once beforehand (no validation per call), as `auto`
  takes it (a graph) and staged with graphs off;
- `floor, ordered`: the zero-copy kernel launched by hand, ordered after the caller's stream as kvferry orders every
  request (record an event on the caller's stream, a lane stream waits for it, launch, record, synchronize the
  event): four driver calls and the launch's argument packing;
- `floor, on the caller's stream`: the launch alone on the caller's stream, then `torch.cuda.synchronize()` (the
  memcpy's own sync): the least any Python caller of this kernel can do;
- `floor, staged`: the gather into a device buffer and one DMA of it (a retrieve: the DMA, then the scatter), both
  on one stream with no ordering after the caller's, then the same sync: the staged path's least;
- `graph xN, replay`: that sequence, its object cut into N row ranges on two streams, captured once as a CUDA graph
  and replayed by torch on the caller's stream (one object only);
- `engine's graph, a request by hand`: the graph the engine replays for this request, launched with what any real
  request needs (ordered after the caller's stream, its ids uploaded, its host copies aimed at the object, an end
  event waited for) and nothing else: the floor under the public call's one-object path;
- `retrieve without a graph, by hand`: a one-object retrieve as separate launches with the same needs, its DMA into
  staging issued first and waiting for nothing (only its scatter waits for the caller's stream).

Also the CPU time of each variant's enqueue (call to return, before the wait). `--chunks N` moves N scattered
objects per request instead (the engine's path then staged; by hand one launch and one batch of DMAs). Run on the
GPU machine:

    PYTHONPATH=src:/tmp/site python3 benchmarks/experiments/one_chunk_floor.py [--reps 200] [--chunks 1]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch

import kvferry
from kvferry import Direction
from kvferry.bench.gpu_transfer_bench import F, Setup, memcpy, paired_ms
from kvferry.kernels import triton_copy
from kvferry.kernels.cuda_driver import driver
from kvferry.transfer.api import _plans
from kvferry.transfer.gpu_engine import EngineConfig, TransferEngine
from kvferry.transfer.request import check


def enqueue_us(enqueue: Callable[[], Callable[[], None]], reps: int) -> float:
    """Median CPU time of `enqueue()` (which returns its wait)."""
    spent = []
    for _ in range(reps):
        t = time.perf_counter()
        wait = enqueue()
        spent.append((time.perf_counter() - t) * 1e6)
        wait()
    return statistics.median(spent)


def variants(
    s: Setup, d: Direction, engine: TransferEngine, ungraphed: TransferEngine
) -> dict[str, Callable[[], Callable[[], None]]]:
    """Each variant's enqueue, returning the wait that completes it."""
    to_objects = d is Direction.D2H
    plan = _plans.triton(s.geom)
    objs = s.objects
    n = len(objs)
    checked = check(s.geom, objs, s.ids, d, s.chunk, 0)
    drv = driver()
    ptrs = [o.data_ptr() for o in objs]
    obj_bytes = s.nbytes // n
    n_ids = len(s.ids)
    ids = s.ids.tolist()
    # ids, then each object's offset in words from the first (in the pool; in the staging buffer), then capacities
    tables = torch.tensor([*ids, *[(p - ptrs[0]) // plan.word for p in ptrs], *[s.chunk] * n]).pin_memory()
    dev_tables = torch.tensor([*ids, *[i * obj_bytes // plan.word for i in range(n)], *[s.chunk] * n]).cuda()
    meta, dmeta = tables.data_ptr(), dev_tables.data_ptr()
    off, cap = meta + n_ids * 8, meta + (n_ids + n) * 8
    rows = n_ids * plan.bs
    staging = torch.empty(s.nbytes, dtype=torch.uint8, device="cuda")
    stage = staging.data_ptr()
    stages = [stage + i * obj_bytes for i in range(n)]
    lane_stream = torch.cuda.Stream(priority=-1).cuda_stream
    start, done = drv.event(), drv.event()
    mode = "zero_copy" if n == 1 else "staged"

    def api(mode: str | None, through: TransferEngine = engine) -> Callable[[], Callable[[], None]]:
        return lambda: (
            kvferry.transfer_async(
                s.paged, objs, s.ids, d, s.fmt, s.chunk, geometry=s.geom, engine=through, mode=mode
            ).wait
        )

    def submit() -> Callable[[], None]:
        return engine.submit(plan, objs, checked, to_objects, s.chunk, 0, mode).wait

    def ordered() -> Callable[[], None]:
        caller = torch._C._cuda_getCurrentRawStream(s.geom.device.index)
        drv.record(start, caller)
        drv.wait(lane_stream, start, 0)
        triton_copy.launch_raw(plan, lane_stream, ptrs[0], off, cap, meta, to_objects, s.chunk, 0, rows)
        drv.record(done, lane_stream)
        return lambda: drv.synchronize(done)

    def direct() -> Callable[[], None]:
        caller = torch._C._cuda_getCurrentRawStream(s.geom.device.index)
        triton_copy.launch_raw(plan, caller, ptrs[0], off, cap, meta, to_objects, s.chunk, 0, rows)
        return torch.cuda.synchronize

    def dmas(caller: int) -> None:
        if n == 1:
            drv.dtoh(ptrs[0], stage, s.nbytes, caller) if to_objects else drv.htod(stage, ptrs[0], s.nbytes, caller)
        elif not drv.has_batch:  # a driver before CUDA 12.8: one DMA per object
            for host, dev in zip(ptrs, stages, strict=True):
                drv.dtoh(host, dev, obj_bytes, caller) if to_objects else drv.htod(dev, host, obj_bytes, caller)
        elif to_objects:  # the scattered objects as one batch for the copy engine
            drv.copy_batch(ptrs, stages, [obj_bytes] * n, caller)
        else:
            drv.copy_batch(stages, ptrs, [obj_bytes] * n, caller)

    def staged() -> Callable[[], None]:  # on a stream of its own: a batch of DMAs refuses the legacy default stream
        doff, dcap = dmeta + n_ids * 8, dmeta + (n_ids + n) * 8
        if not to_objects:
            dmas(lane_stream)
        triton_copy.launch_raw(plan, lane_stream, stage, doff, dcap, dmeta, to_objects, s.chunk, 0, rows)
        if to_objects:
            dmas(lane_stream)
        return torch.cuda.synchronize

    side = torch.cuda.Stream()

    def staged_pieces(pieces: int) -> None:
        """The staged path split into `pieces` row ranges on two streams, so one piece's DMA runs while the next is
        gathered (a store) or scattered (a retrieve): enqueued on the current stream, for a graph to capture."""
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        doff, dcap = dmeta + n_ids * 8, dmeta + (n_ids + n) * 8
        shape = s.geom.object_shape(s.chunk)
        total = shape[0] * shape[1]  # object rows: plane x layer, each one contiguous run of the object
        row_bytes = obj_bytes // total
        cuts = [total * i // pieces for i in range(pieces + 1)]
        for r0, r1 in itertools.pairwise(cuts):
            a, b = r0 * row_bytes, (r1 - r0) * row_bytes
            if to_objects:
                triton_copy.launch_raw(
                    plan, main.cuda_stream, stage, doff, dcap, dmeta, True, s.chunk, 0, rows, (r0, r1)
                )
                side.wait_stream(main)
                drv.dtoh(ptrs[0] + a, stage + a, b, side.cuda_stream)
            else:
                drv.htod(stage + a, ptrs[0] + a, b, side.cuda_stream)
                main.wait_stream(side)
                triton_copy.launch_raw(
                    plan, main.cuda_stream, stage, doff, dcap, dmeta, False, s.chunk, 0, rows, (r0, r1)
                )
        main.wait_stream(side)

    def graph(pieces: int) -> Callable[[], Callable[[], None]] | None:
        """The staged sequence captured once as a CUDA graph (torch's capture) and replayed with torch's `replay` on
        the caller's stream: its addresses are the capture's, so this is the least host work for the request."""
        if n != 1:
            return None
        staged_pieces(pieces)  # compile and warm outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            staged_pieces(pieces)
        torch.cuda.synchronize()
        keep.append(g)
        return lambda: (g.replay(), torch.cuda.synchronize)[1]

    def engine_graph() -> Callable[[], Callable[[], None]] | None:
        """The engine's own graph of this request (`ObjectGraph`) launched by hand: order after the caller's stream,
        upload the ids, aim its host copies at the object, wait, launch, record the end, then wait for that event.
        What any real one-object request must do, with none of the engine's checks or bookkeeping around it."""
        if n != 1:
            return None
        lane = engine._store if to_objects else engine._retrieve
        g = engine._graph(lane, plan, n_ids, s.chunk, checked.rows, s.chunk, to_objects, ptrs[0])
        if g is None:
            return None
        ids_and_cap = torch.tensor([*ids, 0, s.chunk]).pin_memory()
        host_tables = ids_and_cap.data_ptr()

        def request() -> Callable[[], None]:
            drv.record(start, torch._C._cuda_getCurrentRawStream(s.geom.device.index))
            g.launch(ptrs[0], host_tables, start)
            drv.record(done, g.stream)
            return lambda: drv.synchronize(done)

        return request

    def retrieve_by_hand() -> Callable[[], Callable[[], None]] | None:
        """A one-object retrieve without a graph, with what a real request needs: its ids uploaded, its DMA into
        staging issued first (it touches no KV, so it waits for nothing), the scatter ordered after the caller's
        stream, its end recorded and waited for. Against the graph, whose DMA waits for the caller's stream too."""
        if n != 1 or to_objects:
            return None
        doff, dcap = dmeta + n_ids * 8, dmeta + (n_ids + n) * 8

        def request() -> Callable[[], None]:
            drv.record(start, torch._C._cuda_getCurrentRawStream(s.geom.device.index))
            drv.htod(dmeta, meta, (n_ids + 2 * n) * 8, lane_stream)  # one object: the same tables either way
            dmas(lane_stream)
            drv.wait(lane_stream, start, 0)
            triton_copy.launch_raw(plan, lane_stream, stage, doff, dcap, dmeta, False, s.chunk, 0, rows)
            drv.record(done, lane_stream)
            return lambda: drv.synchronize(done)

        return request

    def staged_submit() -> Callable[[], None]:
        return ungraphed.submit(plan, objs, checked, to_objects, s.chunk, 0, "staged").wait

    keep: list[torch.cuda.CUDAGraph] = []
    found = {
        "api, auto": api(None),
        "api, auto, graphs off": api(None, ungraphed),
        "api, staged, graphs off": api("staged", ungraphed),
        f"api, {mode}": api(mode),
        f"submit, {mode}": submit,
        "submit, auto (one object: a graph)": lambda: engine.submit(plan, objs, checked, to_objects, s.chunk, 0).wait,
        "submit, staged, graphs off": staged_submit,
        "floor, ordered": ordered,
        "floor, on the caller's stream": direct,
        "floor, staged": staged,
    }
    for pieces in (1, 2, 4):
        found[f"graph x{pieces}, replay"] = graph(pieces)
    found["engine's graph, a request by hand"] = engine_graph()
    found["retrieve without a graph, by hand"] = retrieve_by_hand()
    return {k: v for k, v in found.items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=1, help="scattered chunk objects per request (default: 1)")
    args = parser.parse_args()
    engine = TransferEngine("cuda")
    ungraphed = TransferEngine("cuda", EngineConfig(graph_max_bytes=0))
    print(f"{torch.cuda.get_device_name()}; ratio = memcpy p50 / variant p50; enqueue = CPU us to return")
    for model in ("qwen2.5-0.5b", "llama3-8b"):
        s = Setup(model, F.NL_X_TWO_NB_BS_NH_HS, args.chunks)
        for d in (Direction.D2H, Direction.H2D):
            ceiling = memcpy(s.nbytes, d is Direction.D2H)
            for name, enqueue in variants(s, d, engine, ungraphed).items():
                for _ in range(20):  # warm: compile, caches
                    enqueue()()
                ours, ceil = (ms * 1e3 for ms in paired_ms(lambda e=enqueue: e()(), ceiling, args.reps))
                cpu = enqueue_us(enqueue, args.reps // 2)
                print(f"{model:13s} {d.name} {name:30s} p50 {ours:7.1f} us  memcpy {ceil:7.1f} us  "
                      f"ratio {ceil / ours:.3f}  enqueue {cpu:6.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
