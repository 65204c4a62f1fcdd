"""Question: does a store that enqueues its copy before its keys and index entries (4ff66ec) make one llama3-8b chunk's
`CacheEngine.store` on the GPU faster than 411768e's store, measured in one process?

Answer (2026-11-30, H200 #2-#5, `... ab_cache_store.py 80`): yes, 26-85 us less per store in every pairing: the
bench_cache_gpu loop 0.759 -> 0.817, 0.850 -> 0.885, 0.740 -> 0.811 of the memcpy; after a 2 ms sleep 0.719 -> 0.768,
0.748 -> 0.805 (docs/benchmark_log.md, 2026-11-30).

An A/B of one llama3-8b chunk's `CacheEngine.store` on the GPU: this tree against a baseline, in one process.

    benchmarks/experiments/baseline_tree.sh REV         # src/kvferry_base: kvferry as of REV
    PYTHONPATH=src python3 benchmarks/experiments/ab_cache_store.py [turns]

The two caches store by turns, one store each per turn, next to a pinned memcpy of the same bytes, so a host whose
speed drifts moves all three alike. Two contexts: what bench_cache_gpu.py's loop runs between two stores (memcpys
both ways and a retrieve) and a 2 ms sleep (the CPU's caches go cold: `store_context_gpu.py` here). Prints the medians
and the median of per-turn ratios to the memcpy.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from typing import Any

import torch

FMT_VALUE = 1  # NL_X_TWO_NB_BS_NH_HS


class Side:
    def __init__(self, package: str, paged_seed: int) -> None:
        cache_mod = importlib.import_module(f"{package}.cache")
        config_mod = importlib.import_module(f"{package}.config")
        formats = importlib.import_module(f"{package}.formats")
        synthetic = importlib.import_module(f"{package}.formats.synthetic")
        self.fmt = formats.EngineKVFormat(FMT_VALUE)
        self.paged = synthetic.make_paged(self.fmt, synthetic.MODELS["llama3-8b"], 1024, 16, device="cuda")
        self.geom = formats.describe(self.fmt, self.paged)
        config = config_mod.KvferryConfig.load(overrides={"cache": {"l1_size_gb": 2.0}})
        self.cache = cache_mod.CacheEngine(config)
        self.ns = self.cache.namespace_for("llama3-8b", self.fmt, self.paged, geometry=self.geom)
        self.n = paged_seed * 10**6
        self.last: tuple[list[int], list[int]] | None = None

    def store(self) -> float:
        self.n += 1000
        tokens = list(range(self.n, self.n + 256))
        ids = torch.randperm(1024)[:16].tolist()
        t = time.perf_counter()
        stored = self.cache.store(tokens, self.paged, ids, self.fmt, namespace=self.ns, geometry=self.geom)
        us = (time.perf_counter() - t) * 1e6
        assert stored == 256
        self.last = (tokens, ids)
        if self.n % 32000 == 0:
            self.cache.clear()
        return us

    def retrieve(self) -> None:
        assert self.last is not None
        tokens, ids = self.last
        self.cache.retrieve(tokens, self.paged, ids[::-1], self.fmt, namespace=self.ns, geometry=self.geom)


def main() -> None:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    sides = {"baseline": Side("kvferry_base", 1), "this tree": Side("kvferry", 2)}
    nbytes = sides["this tree"].geom.bytes_per_token * 256
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def memcpy(to_host: bool = True) -> float:
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6

    def bench_loop(side: Side) -> None:
        memcpy()
        memcpy(False)
        side.retrieve()

    def sleep(side: Side) -> None:
        time.sleep(0.002)

    for side in sides.values():
        for _ in range(8):
            side.store()
    for context, between in (("bench_cache_gpu loop", bench_loop), ("after a 2 ms sleep", sleep)):
        walls: dict[str, list[float]] = {k: [] for k in (*sides, "memcpy")}
        ratios: dict[str, list[float]] = {k: [] for k in sides}
        for turn in range(turns):
            ceiling = memcpy()
            walls["memcpy"].append(ceiling)
            order: list[tuple[str, Any]] = list(sides.items())
            for name, side in order if turn % 2 else order[::-1]:
                between(side)
                us = side.store()
                walls[name].append(us)
                ratios[name].append(ceiling / us)
        med = {k: statistics.median(v) for k, v in walls.items()}
        rows = ", ".join(f"{k} {med[k]:.0f} us (ratio {statistics.median(ratios[k]):.3f})" for k in sides)
        print(f"one chunk store, {context}: {rows}; memcpy {med['memcpy']:.0f} us ({turns} turns)", flush=True)
    for side in sides.values():
        side.cache.close()


if __name__ == "__main__":
    main()
