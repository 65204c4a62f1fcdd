"""Question: how much CPU time does one llama3-8b chunk's `CacheEngine.store` spend before its first GPU launch, with
the CPU's caches warm and cold, and does enqueueing the copy first ("ahead") cut it?

Answer (2026-11-30, CPU machine, `... cache_cpu_cost.py 300`): median (10th percentile) to the first launch, in order
warm 73 (50) / cold 367 (259) us; ahead warm 42 (36) / cold 220 (165) us: ahead is what the cache does since 4ff66ec
(docs/benchmark_log.md, 2026-11-30).

The CPU time of one llama3-8b chunk's store up to its first GPU operation, on any machine, warm and cold.

    python benchmarks/experiments/cache_cpu_cost.py [calls]

The store runs the GPU path's code (`transfer_pool_async` into the transfer engine, `tests/transfer/cpu_engine.py`:
the engine on CPU memory, its driver calls and launches stubbed), so what is timed is the Python from the call to
its first kernel launch, then to the end of the store. "cold": 64 MB of memory are written between two stores,
so none of the path's code or data is in the CPU's caches; on the GPU host a store after idling or after other
work runs like that (`benchmarks/experiments/store_context_gpu.py`: +150-200 us). Both orders of a store are timed
(`kvferry.cache.writer`): in order (keys, pool objects, copy) and ahead (copy, then keys and index entries).
Prints medians and 10th percentiles (this shared machine's speed swings 1.5x between runs).
"""

from __future__ import annotations

import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.transfer
from tests.transfer.cpu_engine import CopyingDriver, World, completion_init, engine_on

from kvferry.cache import CacheEngine, writer
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.kernels import triton_copy
from kvferry.transfer import gpu_engine
from kvferry.transfer.request import check_pool_addresses, check_pool_objects

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


class Done:
    def wait(self) -> None:
        pass


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    launches: list[float] = []
    torch._C._cuda_getCurrentRawStream = lambda index: 0  # no CUDA here
    triton_copy.launch_raw = lambda *args, **kwargs: launches.append(time.perf_counter())  # type: ignore[assignment]
    gpu_engine.Completion.__init__ = completion_init  # type: ignore[method-assign]
    gpu_engine.Completion.__del__ = lambda self: None  # type: ignore[method-assign]
    config = gpu_engine.EngineConfig()
    cache = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 0.5}}))
    engine = engine_on(World(cache.pool, config.slot_bytes), CopyingDriver(copies=False), config)
    # llama3-8b, format 1, every head (a stub of the Triton plan: what `submit` reads)
    plan = types.SimpleNamespace(bs=16, bytes_per_token=32 * 2 * 1024 * 2, word=8, partial_rows=False)

    def enqueue(geom: Any, objects: list[torch.Tensor], ids: Any, direction: Any, chunk: int, skip: int) -> Done:
        checked = check_pool_objects(geom, objects, ids, direction, chunk, skip)
        engine.submit(plan, objects, checked, True, chunk, skip)  # type: ignore[arg-type]
        return Done()

    def enqueue_at(geom: Any, addresses: list[int], ids: Any, direction: Any, chunk: int, skip: int) -> Done:
        checked = check_pool_addresses(geom, addresses, ids, direction, chunk, skip)
        engine.submit(plan, addresses, checked, True, chunk, skip)  # type: ignore[arg-type]
        return Done()

    writer.transfer_pool_async = enqueue  # type: ignore[assignment]  # the API's GPU entry points, minus the device
    writer.transfer_pool_at_async = enqueue_at  # type: ignore[assignment]
    writer._gpu_with_pinned_pool = lambda geom, pool: True  # type: ignore[assignment]
    paged = make_paged(FMT, MODELS["llama3-8b"], 64, 16, device="cpu")
    geom = describe(FMT, paged)
    ns = cache.namespace_for("llama3-8b", FMT, paged, geometry=geom)
    scratch = np.ones(64 << 20, dtype=np.uint8)
    rows: dict[str, tuple[list[float], list[float]]] = {}
    n = 0
    for _ in range(2):  # each case twice, interleaved
        for order in ("in order", "ahead"):
            ahead = order == "ahead"
            writer.copies_in_background = lambda geom, pool, ahead=ahead: ahead  # type: ignore[assignment]
            for cold in (False, True):
                first, total = rows.setdefault(f"{order}, {'cold' if cold else 'warm'}", ([], []))
                for i in range(calls):
                    n += 1
                    tokens, ids = list(range(n * 1000, n * 1000 + 256)), list(range(16))
                    if cold:
                        scratch += 1
                    launches.clear()
                    t = time.perf_counter()
                    assert cache.store(tokens, paged, ids, FMT, namespace=ns, geometry=geom) == 256
                    end = time.perf_counter()
                    if i >= 20:
                        first.append((launches[0] - t) * 1e6)
                        total.append((end - t) * 1e6)
                    if n % 8 == 0:
                        cache.clear()
    print("one llama3-8b chunk's store, CPU us: to its first launch / whole call, median (10th percentile)")
    for name, (first, total) in rows.items():
        print(f"  {name:16s} {statistics.median(first):6.1f} ({np.percentile(first, 10):5.1f})   "
              f"{statistics.median(total):6.1f} ({np.percentile(total, 10):5.1f})")  # fmt: skip
    cache.close()


if __name__ == "__main__":
    main()
