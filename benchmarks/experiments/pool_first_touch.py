"""Question: what does a CPU cache store pay for pool pages it is the first to touch (an unpinned slab)?

Answer (2026-12-01, CPU machine, 820f05a): a store of 16 qwen2.5-0.5b chunks (48 MiB) into fresh pool memory took
16.4 ms against 5.2 ms into pages mapped before (the page faults); `HostPool(populate=True)`, the cache's default
(`cache.l1_populate`), maps the slab at start.

    PYTHONPATH=src python benchmarks/experiments/pool_first_touch.py
"""

from __future__ import annotations

import statistics
import time

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import MODELS, make_paged

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def median_store_ms(populate: bool) -> float:
    kv = make_paged(FMT, MODELS["qwen2.5-0.5b"], 1024, 16)
    config = KvferryConfig.load(env={}, overrides={"cache": {"l1_size_gb": 1.0, "l1_populate": populate}})
    ids = list(range(0, 1024, 4))
    times = []
    with CacheEngine(config, name=f"first-touch-{populate}") as engine:
        ns = engine.namespace_for("first-touch", FMT, kv, block_size=16)
        for n in range(18):  # 18 x 48 MiB: every store into pages no store touched before
            tokens = [n * 100_000 + i for i in range(4096)]
            t = time.perf_counter()
            engine.store(tokens, kv, ids, FMT, namespace=ns, block_size=16)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    for populate in (False, True):
        print(f"populate={populate}: a 16-chunk store takes {median_store_ms(populate):.1f} ms (median)")


if __name__ == "__main__":
    main()
