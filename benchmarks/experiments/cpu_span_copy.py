"""Question: how fast is the CPU copy of 16 qwen2.5-0.5b chunks when the engine's KV is a tensor per layer (as vLLM
allocates it) or one buffer, through the span over all storages (`kernels/cpu_span.py`) against the per-storage
fold it replaced (`build_span` stubbed out)?

Answer (2026-12-01, CPU machine: AMD EPYC, 2 cores; 16 chunks, 1024 blocks, 3 runs): with a tensor per layer the
per-storage fold made a call per (layer, plane, object), 0.12-0.13 / 0.06-0.07 of the copy for qwen2.5-0.5b
(41 / 77 ms) and 0.45 / 0.16 for llama3-8b; the span moves the same bytes at 0.60-0.67 / 0.43-0.56 (qwen) and
0.65 / 0.62 (llama3-8b), as fast as with one buffer (qwen 0.60-0.64 / 0.51-0.61, llama3-8b 0.81 / 0.57). Retrieves
move by +-0.15 between runs here with the machine's memory bandwidth; `--own-threads 2` (the server's way) is
within that spread.

Each case alternates its transfer with a plain copy of the same bytes (`CopyCeiling`); ratios are the copy's median
time over the transfer's. Objects come from a populated `HostPool`, back to back as a cache's store allocates them.

    PYTHONPATH=src python3 benchmarks/experiments/cpu_span_copy.py [--model qwen2.5-0.5b] [--repeats 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvferry import Direction, transfer
from kvferry.bench.timing import CopyCeiling
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.kernels import torch_copy
from kvferry.kernels.cpu_threads import use_own_threads
from kvferry.memory.host_pool import HostPool

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
NB, CHUNKS, BS = 1024, 16, 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--format", type=int, default=int(FMT), help="engine layout (default: 1)")
    parser.add_argument("--own-threads", type=int, default=0, help="copy as the server does, on N kvferry threads")
    args = parser.parse_args()
    if args.own_threads:
        use_own_threads(args.own_threads)
    pool = HostPool(1 << 30, populate=True)
    ids = torch.from_numpy(np.random.default_rng(0).permutation(NB)[: CHUNKS * 256 // BS])
    real_build = torch_copy.build_span
    for allocation in ("per layer", "one buffer"):
        fmt = EngineKVFormat(args.format)
        paged = make_paged(fmt, MODELS[args.model], NB, BS, torch.bfloat16, one_buffer=allocation == "one buffer")
        for path in ("span", "per storage"):
            torch_copy.build_span = real_build if path == "span" else (lambda geom: None)
            geom = describe(fmt, paged, BS)
            objs = [pool.alloc(geom.object_shape(256), geom.dtype) for _ in range(CHUNKS)]
            nbytes = sum(o.nbytes for o in objs)
            for direction in (Direction.D2H, Direction.H2D):
                ceiling = CopyCeiling(torch.device("cpu"), nbytes, direction.name.lower())
                seconds = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    transfer(paged, objs, ids, direction, fmt, geometry=geom, backend="torch")
                    seconds.append(time.perf_counter() - start)
                    ceiling.time_once()
                took = statistics.median(seconds)
                ratio = ceiling.best()[1] / took
                print(f"{args.model} {fmt.value} {allocation:10} {path:11} {direction.name}: {took * 1e3:6.2f} ms, "
                      f"{nbytes / took / 1e9:5.2f} GB/s, {ratio:.2f} of the copy")  # fmt: skip
            for obj in objs:
                pool.free(obj)
    torch_copy.build_span = real_build


if __name__ == "__main__":
    main()
