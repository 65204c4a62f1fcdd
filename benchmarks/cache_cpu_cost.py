"""CPU cost of one chunk's `CacheEngine.store` / `.retrieve` around its copy, on any machine: the copy itself is
replaced by the request check the GPU path runs (`check_pool_objects`), so this times the cache's Python only.

    python benchmarks/cache_cpu_cost.py [calls]

Prints the store's time up to its copy (what delays the first GPU operation), the same plus the check, the time
after it, and the retrieve's; the 10th percentile over the calls (this shared machine's speed swings 1.5x between
runs, and the low end is the code's own cost).
"""

from __future__ import annotations

import sys
import time

import kvferry.cache.engine as cache_engine
from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.transfer.request import check_pool_objects


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    stamps: list[tuple[float, float]] = []

    def checked_only(paged, objects, ids, direction, fmt, chunk, skip, geometry=None, **_):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        check_pool_objects(geometry, objects, ids, direction, chunk, skip)
        stamps.append((started, time.perf_counter()))

    cache_engine.transfer = checked_only  # a CPU engine's copy goes through this name
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS["llama3-8b"], 64, 16, device="cpu")
    geom = describe(fmt, paged)
    cache = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 2.0}}))
    ns = cache.namespace_for("llama3-8b", fmt, paged, geometry=geom)
    times: dict[str, list[float]] = {k: [] for k in ("store to its copy", "+ check", "after", "retrieve to its copy")}
    for i in range(calls):
        tokens, ids = list(range(i * 1000, i * 1000 + 256)), list(range(16))
        t = time.perf_counter()
        cache.store(tokens, paged, ids, fmt, namespace=ns, geometry=geom)
        end = time.perf_counter()
        times["store to its copy"].append(stamps[-1][0] - t)
        times["+ check"].append(stamps[-1][1] - t)
        times["after"].append(end - stamps[-1][1])
        t = time.perf_counter()
        cache.retrieve(tokens, paged, ids, fmt, namespace=ns, geometry=geom)
        times["retrieve to its copy"].append(stamps[-1][0] - t)
    low = {k: sorted(v[200:])[len(v[200:]) // 10] * 1e6 for k, v in times.items()}
    print("one llama3-8b chunk, us (10th percentile): " + ", ".join(f"{k} {v:.1f}" for k, v in low.items()))
    cache.close()


if __name__ == "__main__":
    main()
