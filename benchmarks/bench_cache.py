"""Cache engine overheads: prefix lookup time, and the Python cost per chunk of store/retrieve.

    python benchmarks/bench_cache.py [--repeats 50] [--out bench-out/bench_cache.json]

Cases:
  lookup_128k      lookup of a 131072-token prompt, all 512 chunks (256 tokens) hit, tokens given as a
                   numpy array, a torch tensor, or a Python list (the list pays its conversion to uint32 bytes)
  lookup_miss      the same prompt when its first chunk misses (hashing stops at the first miss)
  store/retrieve   time through the cache API minus the time of the bare kvferry.transfer of the same blocks
                   into/out of the same objects, divided by the number of chunks: the cache's bookkeeping
                   (hashing, index, locks, eviction checks, metrics) per chunk. With ``geometry=`` (an engine
                   that registered its KV once) and without (the engine's tensors described on every call).
Targets: lookup_128k < 1 ms; per-chunk overhead < 20 us. Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.memory import HostPool
from kvferry.transfer import Direction, transfer

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
CHUNK = 256
BS = 16
# Small objects (2 x 4 layers x 256 tokens x 64 wide, bf16: 256 KiB) keep the copy short, so the
# subtraction that isolates the cache's own time is not lost in the copy's noise.
DIMS = ModelDims(nl=4, nh=2, hs=32)


def median_us(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def bench_lookup(repeats: int) -> dict[str, float]:
    paged = make_paged(FMT, DIMS, num_blocks=CHUNK // BS, block_size=BS, dtype=torch.bfloat16)
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK}})
    # The index is what lookup reads: fill it through the public API with 512 small-model objects.
    pool = HostPool(600 * 4 * 2 * CHUNK * 64 * 2, pin=False)
    tokens = np.random.default_rng(0).integers(0, 150_000, size=512 * CHUNK, dtype=np.int64)
    with CacheEngine(config, pool=pool) as engine:
        engine.namespace = engine.namespace_for("bench", FMT, paged)
        geom = describe(FMT, paged)
        for c in range(512):  # chunk by chunk, reusing the engine blocks of one chunk
            ids = [0] * (c * CHUNK // BS) + list(range(CHUNK // BS))
            engine.store(tokens[: (c + 1) * CHUNK], paged, ids, FMT, geometry=geom, skip_prefix_tokens=c * CHUNK)
        assert engine.lookup(tokens) == 512 * CHUNK
        as_list, as_tensor = tokens.tolist(), torch.from_numpy(tokens)
        missing = tokens.copy()
        missing[0] += 1
        return {
            "lookup_128k_numpy_us": median_us(lambda: engine.lookup(tokens), repeats),
            "lookup_128k_tensor_us": median_us(lambda: engine.lookup(as_tensor), repeats),
            "lookup_128k_list_us": median_us(lambda: engine.lookup(as_list), repeats),
            "lookup_128k_locked_us": median_us(
                lambda: engine.free_lookup_locks(engine.lookup_status(tokens, lock=True).lock_id or 0), repeats
            ),
            "lookup_miss_us": median_us(lambda: engine.lookup(missing), repeats),
        }


def bench_overhead(n_chunks: int, repeats: int, with_geometry: bool) -> dict[str, Any]:
    """Bare transfer and API call alternate, so both see the same machine load.

    Two estimates of the cache's own time per chunk: ``interleaved`` = (API - bare) from alternating runs
    (min and median over runs), and ``in_call`` = API wall time minus the time the engine itself spent inside
    its transfer call in that same call (median; immune to run-to-run noise in the copy).
    """
    n_blocks = n_chunks * CHUNK // BS
    paged = make_paged(FMT, DIMS, num_blocks=n_blocks + 8, block_size=BS, dtype=torch.bfloat16)
    geom = describe(FMT, paged)
    shape = geom.object_shape(CHUNK)
    obj_bytes = int(np.prod(shape)) * 2
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK}})
    pool = HostPool(2 * (n_chunks + 1) * (obj_bytes + 4096) // 4096 * 4096, pin=False)
    ids = torch.randperm(n_blocks + 8)[:n_blocks].tolist()
    rng = np.random.default_rng(1)
    kwargs = {"geometry": geom} if with_geometry else {}
    samples: dict[str, list[float]] = {k: [] for k in ("bare_d2h", "store", "store_in", "bare_h2d", "retr", "retr_in")}
    with CacheEngine(config, pool=pool) as engine:
        engine.namespace = engine.namespace_for("bench", FMT, paged)
        objects = [pool.alloc(shape, torch.bfloat16) for _ in range(n_chunks)]
        counters = engine.counters

        def timed(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6

        for i in range(repeats + 1):
            tokens = rng.integers(0, 150_000, size=n_chunks * CHUNK, dtype=np.int64)
            bare_d2h = timed(lambda: transfer(paged, objects, ids, Direction.D2H, FMT, chunk_size=CHUNK, geometry=geom))
            inside = counters.store_seconds
            store = timed(lambda t=tokens: engine.store(t, paged, ids, FMT, **kwargs))
            store_in = store - (counters.store_seconds - inside) * 1e6
            bare_h2d = timed(lambda: transfer(paged, objects, ids, Direction.H2D, FMT, chunk_size=CHUNK, geometry=geom))
            inside = counters.retrieve_seconds
            retr = timed(lambda t=tokens: engine.retrieve(t, paged, ids, FMT, **kwargs))
            retr_in = retr - (counters.retrieve_seconds - inside) * 1e6
            engine.clear()
            if i:  # the first round warms plan caches
                for name, value in zip(samples, (bare_d2h, store, store_in, bare_h2d, retr, retr_in), strict=True):
                    samples[name].append(value)
    med = {name: statistics.median(values) for name, values in samples.items()}
    low = {name: min(values) for name, values in samples.items()}
    return {
        "chunks": n_chunks,
        "geometry_given": with_geometry,
        "bare_store_us": med["bare_d2h"],
        "api_store_us": med["store"],
        "store_overhead_per_chunk_us": {
            "interleaved_min": (low["store"] - low["bare_d2h"]) / n_chunks,
            "interleaved_median": (med["store"] - med["bare_d2h"]) / n_chunks,
            "in_call_median": med["store_in"] / n_chunks,
        },
        "bare_retrieve_us": med["bare_h2d"],
        "api_retrieve_us": med["retr"],
        "retrieve_overhead_per_chunk_us": {
            "interleaved_min": (low["retr"] - low["bare_h2d"]) / n_chunks,
            "interleaved_median": (med["retr"] - med["bare_h2d"]) / n_chunks,
            "in_call_median": med["retr_in"] / n_chunks,
        },
    }


def calibration_s() -> float:
    """Seconds for 10M trivial interpreter steps: tells how busy the machine was (about 0.4 s when idle)."""
    start = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("bench-out/bench_cache.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    calibration = calibration_s()
    lookup = bench_lookup(args.repeats)
    overhead = [bench_overhead(n, args.repeats, g) for g in (True, False) for n in (1, 16, 64)]
    result = {
        "machine": platform.node(),
        "torch": torch.__version__,
        "calibration_10M_steps_s": calibration,
        "lookup": lookup,
        "overhead": overhead,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"calibration: 10M interpreter steps took {calibration:.2f} s (about 0.4 s on an idle machine)\n")
    print(f"{'lookup case':<28}{'median us':>12}")
    for name, value in lookup.items():
        print(f"{name:<28}{value:>12.1f}")
    print("\ncache overhead per chunk, us (interleaved min / interleaved median / in-call median)")
    print(
        f"{'chunks':>6} {'geometry':>9} {'bare store':>11} {'api store':>10} {'store ovh/chunk':>22} "
        f"{'bare retr':>10} {'api retr':>9} {'retrieve ovh/chunk':>22}"
    )
    for row in overhead:
        so, ro = row["store_overhead_per_chunk_us"], row["retrieve_overhead_per_chunk_us"]
        print(
            f"{row['chunks']:>6} {('given' if row['geometry_given'] else 'per call'):>9} "
            f"{row['bare_store_us']:>11.1f} {row['api_store_us']:>10.1f} "
            f"{so['interleaved_min']:>6.1f} /{so['interleaved_median']:>6.1f} /{so['in_call_median']:>6.1f} "
            f"{row['bare_retrieve_us']:>10.1f} {row['api_retrieve_us']:>9.1f} "
            f"{ro['interleaved_min']:>6.1f} /{ro['interleaved_median']:>6.1f} /{ro['in_call_median']:>6.1f}"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
