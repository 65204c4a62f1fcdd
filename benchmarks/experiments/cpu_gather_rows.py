"""Question: what limits a 16-chunk qwen2.5-0.5b transfer of CPU KV: the gather of its 12288 block pieces of 4 KiB
itself, or how it is measured? Times, with nothing of kvferry around it, a gather of random 4 KiB rows of a large KV
cache into one buffer against two memcpys of the same 48 MiB (from a window of the cache that moves each time, as a
gather reads DRAM; and between two fixed buffers, as the benchmarks' ceilings do), then an in-process `CacheEngine`
store and retrieve of 16 chunks back to back against the same after a 30 ms idle spell (the benchmarks pause that
long after each ceiling copy for torch's OpenMP threads to stop spinning).

Answer (2026-12-02, CPU machine: AMD EPYC, 2 cores, 32 MiB L3; 90020de; 3 passes): a 48 MiB memcpy 2.3-3.3 ms from
DRAM, 2.0-2.9 between two fixed buffers; the gather (`torch.index_select`, 2 threads) 0.65-0.92 of the first with
random ids (0.58-0.81 of the second), 0.83-1.00 with the ids sorted, numpy's `take` 0.11-0.15. The cache's 16 chunks
back to back: store 4.4-5.1 ms, retrieve 4.2-6.5; after a 30 ms idle spell 5.7-6.2 and 8.2-8.7 (about what one
thread takes: 6.7-7.2 ms for the retrieve). So the gather itself is near a memcpy; what holds the CPU KV rows of
`kvferry bench server` at 0.4-0.6 is mostly the idle spell each request there follows (a retrieve's second copy
thread or the CPU itself slow to wake on this 2-core machine), which finer spans did not help (docs/benchmark_log.md).

    python3 benchmarks/experiments/cpu_gather_rows.py [--threads 2] [--passes 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvferry.bench.server_bench import BS, CHUNK, FMT, NB, PER_CHUNK
from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats.synthetic import MODELS, make_paged


def median_ms(fn: Callable[[], object], reps: int = 15, idle_s: float = 0.0) -> float:
    spent = []
    for _ in range(reps):
        time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e3


def primitives() -> str:
    pieces, row = 24 * 2 * 4096, 2048  # a 4096-block cache's pieces; one piece = 16 tokens x 2 heads x 64 (bf16)
    kv = torch.randn(pieces, row).to(torch.bfloat16)
    ids = torch.randint(0, pieces, (24 * 2 * 256,))
    out = torch.empty(len(ids), row, dtype=torch.bfloat16)
    dst, fixed = torch.empty(out.numel(), dtype=torch.bfloat16), torch.ones(out.numel(), dtype=torch.bfloat16)
    flat = kv.view(-1)
    windows = [flat[i * dst.numel() : (i + 1) * dst.numel()] for i in range(flat.numel() // dst.numel())]
    turn = iter(range(1 << 30))
    kv_np, out_np, ids_np = kv.view(torch.int16).numpy(), out.view(torch.int16).numpy(), ids.numpy()
    ordered = ids.sort().values
    from_dram = median_ms(lambda: dst.copy_(windows[next(turn) % len(windows)]))
    between_two = median_ms(lambda: dst.copy_(fixed))
    rows = {
        "index_select, random ids": median_ms(lambda: torch.index_select(kv, 0, ids, out=out)),
        "index_select, sorted ids": median_ms(lambda: torch.index_select(kv, 0, ordered, out=out)),
        "numpy take, random ids": median_ms(lambda: np.take(kv_np, ids_np, axis=0, out=out_np)),
    }
    head = f"memcpy of 48 MiB from DRAM {from_dram:.2f} ms, between two fixed buffers {between_two:.2f} ms; "
    return head + "; ".join(
        f"{name} {ms:.2f} ms ({from_dram / ms:.2f}, {between_two / ms:.2f})" for name, ms in rows.items()
    )  # fmt: skip


def cache_back_to_back() -> str:
    kv = make_paged(
        FMT, MODELS["qwen2.5-0.5b"], NB, BS, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)
    )
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 2.0}})
    rng = np.random.default_rng(1)
    fresh = iter(range(1, 1 << 30))
    with CacheEngine(config, name="gather-rows") as engine:
        ns = engine.namespace_for("gather-rows", FMT, kv, block_size=BS)
        tokens = list(range(16 * CHUNK))

        def ids() -> list[int]:
            return rng.permutation(NB)[: 16 * PER_CHUNK].tolist()

        def store() -> None:  # a new prefix each time
            engine.store([t + next(fresh) * len(tokens) for t in tokens], kv, ids(), FMT, namespace=ns, block_size=BS)

        engine.store(tokens, kv, ids(), FMT, namespace=ns, block_size=BS)
        cases = {
            "store": median_ms(store, 9),
            "retrieve": median_ms(lambda: engine.retrieve(tokens, kv, ids(), FMT, namespace=ns, block_size=BS), 9),
            "store after 30 ms idle": median_ms(store, 9, 0.03),
            "retrieve after 30 ms idle": median_ms(
                lambda: engine.retrieve(tokens, kv, ids(), FMT, namespace=ns, block_size=BS), 9, 0.03
            ),
        }
    return "CacheEngine, 16 chunks: " + "; ".join(f"{name} {ms:.2f} ms" for name, ms in cases.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for _ in range(args.passes):
        print(primitives())
        print(cache_back_to_back())


if __name__ == "__main__":
    main()
