"""Question: does what runs between two stores change a one-chunk `CacheEngine.store`'s time on the GPU host?

Answer (2026-11-30, H200 #6, `--turns 4`): yes: of the memcpy, 0.875 after the bench_cache_gpu loop's copies and a
retrieve, 0.879 after another store, 0.867 after a retrieve, 0.859 after a memcpy, 0.763 after a 2 ms sleep, 0.730
after 64 MB of CPU-cache thrash: a store that starts with cold CPU caches pays ~120-150 us (docs/benchmark_log.md).

One llama3-8b chunk through `CacheEngine.store` on a GPU engine, with different work between consecutive stores (the
loop of `kvferry bench cache-gpu` is the first).

Run on the GPU machine:  PYTHONPATH=src python3 benchmarks/experiments/store_context_gpu.py [--trace OUT_DIR]
Every variant runs in turns of 8 stores, round robin, so a host whose speed drifts moves them alike; each store's
wall time is divided into the same turn's memcpy medians. `--trace`: a torch.profiler (CUPTI) timeline of the
bench_cache_gpu loop, summarised per store: when its first GPU operation starts after the Python call, its DMAs, and
when the last one ends (the profiler slows the CPU side; the GPU spans are what it is for).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged

F = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


class Loop:
    def __init__(self) -> None:
        self.paged = make_paged(F, MODELS["llama3-8b"], 1024, 16, device="cuda")
        self.geom = describe(F, self.paged)
        self.cache = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 4.0}}))
        self.ns = self.cache.namespace_for("llama3-8b", F, self.paged, geometry=self.geom)
        nbytes = self.geom.bytes_per_token * 256
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.scratch = np.ones(64 << 20, dtype=np.uint8)  # larger than the host's last-level cache share
        self.n = 0
        self.last: tuple[list[int], list[int]] = ([], [])

    def memcpy(self, to_host: bool = True) -> None:
        self.host.copy_(self.dev, non_blocking=True) if to_host else self.dev.copy_(self.host, non_blocking=True)
        torch.cuda.synchronize()

    def memcpy_h2d(self) -> None:
        self.memcpy(False)

    def store(self) -> float:
        self.n += 1
        tokens = list(range(self.n * 1000, self.n * 1000 + 256))
        ids = torch.randperm(1024)[:16].tolist()
        self.last = (tokens, ids)
        t = time.perf_counter()
        stored = self.cache.store(tokens, self.paged, ids, F, namespace=self.ns, geometry=self.geom)
        us = (time.perf_counter() - t) * 1e6
        assert stored == 256
        return us

    def retrieve(self) -> None:
        tokens, ids = self.last
        self.cache.retrieve(tokens, self.paged, ids[::-1], F, namespace=self.ns, geometry=self.geom)

    def thrash(self) -> None:
        self.scratch += 1  # reads and writes 64 MB: the CPU's caches hold none of kvferry's code or data after it


def variants(loop: Loop) -> dict[str, Callable[[], None]]:
    def between(*steps: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for step in steps:
                step()

        return run

    return {
        "bench loop (memcpy d2h, memcpy h2d, retrieve)": between(loop.memcpy, loop.memcpy_h2d, loop.retrieve),
        "memcpy d2h only": between(loop.memcpy),
        "retrieve only": between(loop.retrieve),
        "another store": between(loop.store),  # type: ignore[arg-type]
        "sleep 2 ms": between(lambda: time.sleep(0.002)),
        "64 MB of CPU cache thrash": between(loop.thrash),
        "thrash then memcpy": between(loop.thrash, loop.memcpy),
        "bench loop, gc off": between(loop.memcpy, loop.memcpy_h2d, loop.retrieve),
    }


def contexts(loop: Loop, turns: int) -> None:
    runs = variants(loop)
    ratios: dict[str, list[float]] = {k: [] for k in runs}
    walls: dict[str, list[float]] = {k: [] for k in runs}
    for turn in range(turns):
        for name, between in runs.items():
            loop.cache.clear()
            ceiling = []
            for _ in range(3):
                t = time.perf_counter()
                loop.memcpy()
                ceiling.append((time.perf_counter() - t) * 1e6)
            memcpy = statistics.median(ceiling)
            if "gc off" in name:
                gc.disable()
            for i in range(9):
                between()
                us = loop.store()
                if i and turn:  # the first turn and each turn's first store warm up
                    walls[name].append(us)
                    ratios[name].append(memcpy / us)
            gc.enable()
    for name in runs:
        print(f"store after {name}: {statistics.median(walls[name]):.0f} us, ratio to memcpy "
              f"{statistics.median(ratios[name]):.3f} (p25 {np.percentile(ratios[name], 25):.3f}, "
              f"p75 {np.percentile(ratios[name], 75):.3f}, n={len(walls[name])})", flush=True)  # fmt: skip


def timeline(loop: Loop, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    loop.cache.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            with record_function("memcpy d2h"):
                loop.memcpy()
            loop.memcpy_h2d()
            with record_function("store"):
                loop.store()
            loop.retrieve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "store_timeline.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")), key=lambda e: e["ts"])
    rows: dict[str, list[list[float]]] = {"store": [], "memcpy d2h": []}
    for span in (e for e in events if e.get("cat") == "user_annotation" and e["name"] in rows):
        t0, t1 = span["ts"], span["ts"] + span["dur"]
        inside = [g for g in gpu if t0 <= g["ts"] <= t1]
        if not inside:
            continue
        first, last = inside[0]["ts"] - t0, max(g["ts"] + g["dur"] for g in inside) - t0
        dmas = [g for g in inside if g["cat"] == "gpu_memcpy" and g["dur"] > 20]
        dma_span = (dmas[-1]["ts"] + dmas[-1]["dur"] - dmas[0]["ts"]) if dmas else 0.0
        rows[span["name"]].append([span["dur"], first, last, span["dur"] - last, dma_span, len(inside)])
    names = ("wall", "first GPU op at", "last GPU op ends at", "after it", "DMA span", "GPU ops")
    for kind, vals in rows.items():
        med = np.median(np.array(vals[3:]), axis=0)
        print(f"timeline, {kind} (us, medians of {len(vals) - 3}, profiled): "
              + ", ".join(f"{n} {v:.0f}" for n, v in zip(names, med, strict=True)), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--trace", type=Path, default=None, help="write the timeline's chrome trace here")
    args = ap.parse_args()
    loop = Loop()
    for _ in range(10):
        loop.store()
    contexts(loop, args.turns)
    if args.trace is not None:
        timeline(loop, args.trace)
    loop.cache.close()


if __name__ == "__main__":
    main()
