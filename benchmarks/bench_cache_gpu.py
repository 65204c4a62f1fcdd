"""End-to-end store/retrieve of one 256-token chunk through the CacheEngine API on a GPU engine (issue 4).

Run on the GPU machine: PYTHONPATH=src python3 benchmarks/bench_cache_gpu.py
Wall time from the Python call to the bytes having moved, vs a same-run single pinned memcpy of the same bytes.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged


def memcpy_us(nbytes: int, to_host: bool, reps: int) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times[2:])


def main() -> None:
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    for model in ("llama3-8b", "qwen2.5-0.5b"):
        paged = make_paged(fmt, MODELS[model], 1024, 16, device="cuda")
        geom = describe(fmt, paged)
        cache = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 2.0}}))
        ns = cache.namespace_for(model, fmt, paged, geometry=geom)
        nbytes = geom.bytes_per_token * 256
        store, retrieve = [], []
        for i in range(40):
            tokens = list(range(i * 1000, i * 1000 + 256))
            ids = torch.randperm(1024)[:16].tolist()
            t = time.perf_counter()
            assert cache.store(tokens, paged, ids, fmt, namespace=ns, geometry=geom) == 256
            store.append((time.perf_counter() - t) * 1e6)
            t = time.perf_counter()
            assert cache.retrieve(tokens, paged, ids[::-1], fmt, namespace=ns, geometry=geom) == 256
            retrieve.append((time.perf_counter() - t) * 1e6)
        for name, times, to_host in (("store", store, True), ("retrieve", retrieve, False)):
            ours = statistics.median(times[5:])
            ceil = memcpy_us(nbytes, to_host, 40)
            print(f"{model} one chunk {name} via CacheEngine: {ours:.0f} us, memcpy {ceil:.0f} us, "
                  f"ratio {ceil / ours:.3f} ({nbytes / 2**20:.1f} MiB)", flush=True)  # fmt: skip
        cache.close()


if __name__ == "__main__":
    main()
