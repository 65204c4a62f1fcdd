"""Question: does this tree's one-chunk transfer cost more or less than a baseline commit's, on the same host?

Answer (2026-12-01, H200): 1a247f3 (token tiles and head slices in the kernel) against 173cb43: llama3-8b one chunk
697 / 699 us store, 678 / 677 retrieve; qwen2.5-0.5b 127 / 128, 113 / 113: the same.

One process holds both trees (`benchmarks/experiments/baseline_tree.sh REV` makes `src/kvferry_base`); every turn
times the baseline, this tree and a pinned memcpy of the same bytes back to back (order alternating), so a host whose
speed drifts moves all three alike. Prints medians of the call-to-completion wall time, its ratio to the memcpy, and
the CPU time of the enqueue.

    benchmarks/experiments/baseline_tree.sh 173cb43
    PYTHONPATH=src python3 benchmarks/experiments/ab_transfer_tree.py [turns]
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from typing import Any

import torch


class Side:
    def __init__(self, package: str, model: str, seed: int) -> None:
        kv = importlib.import_module(package)
        synthetic = importlib.import_module(f"{package}.formats.synthetic")
        memory = importlib.import_module(f"{package}.memory")
        engine_mod = importlib.import_module(f"{package}.transfer.gpu_engine")
        self.kv = kv
        self.fmt = kv.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
        torch.manual_seed(seed)
        self.paged = synthetic.make_paged(self.fmt, synthetic.MODELS[model], 1024, 16, device="cuda")
        self.geom = kv.describe(self.fmt, self.paged)
        self.pool = memory.HostPool(1 << 28)
        self.objects = [self.pool.alloc(self.geom.object_shape(256), self.geom.dtype)]
        self.ids = torch.randperm(1024)[:16].tolist()
        self.engine = engine_mod.TransferEngine("cuda", engine_mod.EngineConfig())
        self.nbytes = self.objects[0].nbytes

    def run(self, direction: Any) -> tuple[float, float]:
        """(wall us from the call to completion, CPU us of the enqueue)."""
        d = self.kv.Direction[direction]
        t = time.perf_counter()
        handle = self.kv.transfer_async(self.paged, self.objects, self.ids, d, self.fmt, geometry=self.geom,
                                        engine=self.engine)  # fmt: skip
        enqueued = time.perf_counter()
        handle.wait()
        done = time.perf_counter()
        return (done - t) * 1e6, (enqueued - t) * 1e6


def memcpy(dev: torch.Tensor, host: torch.Tensor, to_host: bool) -> float:
    t = time.perf_counter()
    host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6


def main() -> None:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    for model in ("llama3-8b", "qwen2.5-0.5b"):
        sides = {"baseline": Side("kvferry_base", model, 1), "this tree": Side("kvferry", model, 2)}
        nbytes = sides["this tree"].nbytes
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for direction in ("D2H", "H2D"):
            for side in sides.values():
                for _ in range(10):
                    side.run(direction)
            walls: dict[str, list[float]] = {k: [] for k in sides}
            cpu: dict[str, list[float]] = {k: [] for k in sides}
            ratios: dict[str, list[float]] = {k: [] for k in sides}
            ceilings = []
            for turn in range(turns):
                ceiling = memcpy(dev, host, direction == "D2H")
                ceilings.append(ceiling)
                order = list(sides.items())
                for name, side in order if turn % 2 else order[::-1]:
                    wall, enqueue = side.run(direction)
                    walls[name].append(wall)
                    cpu[name].append(enqueue)
                    ratios[name].append(ceiling / wall)
            rows = ", ".join(
                f"{k} {statistics.median(walls[k]):.0f} us (ratio {statistics.median(ratios[k]):.3f}, enqueue "
                f"{statistics.median(cpu[k]):.0f} us)"
                for k in sides
            )
            print(f"{model} one chunk {direction}: {rows}; memcpy {statistics.median(ceilings):.0f} us", flush=True)


if __name__ == "__main__":
    main()
