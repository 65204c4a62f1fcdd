"""Question: does a GPU `EngineConfig` setting (an experiment's new field, or a value) make one-chunk transfers
faster than the defaults, measured in one process?

Answers (docs/benchmark_log.md): 2026-11-29 (H200 #20, `metadata_in_place_below=0` on that experiment's tree):
no, block ids read by the kernels in pinned memory ran slower (llama D2H 0.866 against 0.891, H2D 0.877 against
0.919), reverted; 2026-11-30 (H200 #5, `edge_slice_bytes=0`): a 4 MiB first slice made no difference above the
noise (723 vs 712 us, then 683 vs 689), dropped. Neither field exists any more.

An A/B of two GPU engine settings on one-chunk requests, in one process, interleaved with the memcpy ceiling.

Run on the GPU machine:  PYTHONPATH=src python3 benchmarks/experiments/ab_engine_config.py FIELD=INT ...
The first engine has the default settings, the second the given `EngineConfig` overrides (int values). Every
repetition times A, B and the ceiling back to back, so a host whose speed drifts moves all three alike.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import kvferry
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.memory import HostPool
from kvferry.transfer.gpu_engine import EngineConfig, TransferEngine

F = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def main() -> None:
    overrides = {k: int(v) for k, v in (arg.split("=", 1) for arg in sys.argv[1:])}
    engines = {"A (default)": TransferEngine("cuda", EngineConfig()), f"B {overrides}": TransferEngine(
        "cuda", EngineConfig(**overrides))}  # fmt: skip
    pool = HostPool(1 << 30)
    for model in ("llama3-8b", "qwen2.5-0.5b"):
        paged = make_paged(F, MODELS[model], 1024, 16, device="cuda")
        geom = describe(F, paged)
        obj = pool.alloc(geom.object_shape(256), geom.dtype)
        nbytes = obj.nbytes
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for direction in ("D2H", "H2D"):
            times: dict[str, list[float]] = {name: [] for name in (*engines, "memcpy")}

            for rep in range(80):
                ids = torch.randperm(1024)[:16].tolist()
                for name, run in [*((n, e) for n, e in engines.items()), ("memcpy", None)]:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    if run is None:
                        host.copy_(dev, non_blocking=True) if direction == "D2H" else dev.copy_(host, non_blocking=True)
                        torch.cuda.synchronize()
                    else:
                        kvferry.transfer_async(paged, [obj], ids, direction, F, geometry=geom, engine=run).wait()
                    if rep >= 10:
                        times[name].append((time.perf_counter() - t) * 1e6)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows = ", ".join(f"{k} {v:.0f} us (ratio {med['memcpy'] / v:.3f})" for k, v in med.items())
            print(f"{model} one chunk {direction} ({nbytes / 2**20:.0f} MiB): {rows}", flush=True)
        pool.free(obj)


if __name__ == "__main__":
    main()
