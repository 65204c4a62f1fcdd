"""Question: is this tree's CPU transfer (torch backend) faster or slower than a baseline commit's, per layout and
per way the engine allocates its KV?

Answer (2026-12-01, CPU machine, 2 cores; this tree = the span over all storages with folds where they do better,
against 5d16f0e; 16 chunks; base/this is the baseline's median time over this tree's, so above 1 is faster): with a
tensor per layer, qwen2.5-0.5b store / retrieve: format 1 3.8-7.2 / 4.7-6.3, HND (6, 7) 3.0-3.9 / 2.5-3.5, fused
(11) 2.6-4.2 / 2.7-3.6, vLLM's CPU layout (102) 1.1 / 3.7, its AMX layout (103) 0.96-0.98 / 1.4; llama3-8b format 1
1.6 / 2.0, HND 1.3 / 1.0, 102 0.97 / 1.4. With one buffer the code paths are the old ones except format 1 (1.1-1.2
llama3-8b and qwen2.5-0.5b) and HND's stores of a tensor per layer; the rest moved by 0.85-1.21, this machine's
spread between two turns of the same code.

One process holds both trees (`benchmarks/experiments/baseline_tree.sh REV` makes `src/kvferry_base`); every turn
times this tree then the baseline on the same engine tensors and pool objects, with a 30 ms pause after each call
(torch's OpenMP threads stop spinning), and prints medians.

    benchmarks/experiments/baseline_tree.sh 5d16f0e
    PYTHONPATH=src python3 benchmarks/experiments/ab_cpu_transfer_tree.py MODEL FORMATS {one,per} TURNS
    e.g. ... ab_cpu_transfer_tree.py qwen2.5-0.5b 1,6,102,103 per 7
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time

import numpy as np
import torch

import kvferry
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.memory.host_pool import HostPool

NB, CHUNKS, BS = 1024, 16, 16


def main() -> None:
    model, formats, allocation, turns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    one_buffer = allocation == "one"
    kvferry_base = importlib.import_module("kvferry_base")
    pool = HostPool(2 << 30, populate=True)
    ids = torch.from_numpy(np.random.default_rng(0).permutation(NB)[: CHUNKS * 256 // BS])
    for fmt in (EngineKVFormat(int(f)) for f in formats.split(",")):
        paged = make_paged(fmt, MODELS[model], NB, BS, torch.bfloat16, one_buffer=one_buffer)
        base_geom = kvferry_base.describe(int(fmt), paged, BS)
        trees = {"new": (kvferry, describe(fmt, paged, BS)), "base": (kvferry_base, base_geom)}
        geom = trees["new"][1]
        objs = [pool.alloc(geom.object_shape(256), geom.dtype) for _ in range(CHUNKS)]
        for direction in ("d2h", "h2d"):
            seconds: dict[str, list[float]] = {name: [] for name in trees}
            for _ in range(turns):
                for name, (tree, g) in trees.items():
                    start = time.perf_counter()
                    tree.transfer(paged, objs, ids, direction, int(fmt), geometry=g, backend="torch")
                    seconds[name].append(time.perf_counter() - start)
                    time.sleep(0.03)
            new, base = (statistics.median(seconds[name]) for name in ("new", "base"))
            print(f"{model} {fmt.value} {allocation} {direction}: this tree {new * 1e3:.1f} ms, "
                  f"base {base * 1e3:.1f} ms, base/this {base / new:.2f}")  # fmt: skip
        for obj in objs:
            pool.free(obj)


if __name__ == "__main__":
    main()
