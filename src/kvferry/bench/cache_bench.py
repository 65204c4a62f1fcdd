"""`kvferry bench cache`: cache engine overheads: prefix lookup time, and the Python cost per chunk of store/retrieve.

Cases:
  lookup_128k      lookup of a 131072-token prompt, all 512 chunks (256 tokens) hit, tokens given as a
                   numpy array, a torch tensor, or a Python list (the list pays its conversion to uint32 bytes)
  lookup_miss      the same prompt when its first chunk misses (hashing stops at the first miss)
  store/retrieve   time through the cache API minus the time of the bare kvferry.transfer of the same blocks
                   into/out of the same objects, divided by the number of chunks: the cache's bookkeeping
                   (hashing, index, locks, eviction checks, metrics) per chunk. With `geometry=` (an engine
                   that registered its KV once) and without (the engine's tensors described on every call).
Targets: lookup_128k < 1 ms; per-chunk overhead < 20 us. Medians of --repeats runs, on one torch thread.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, positive
from kvferry.bench.report import new_table
from kvferry.bench.timing import elapsed_us, median_us
from kvferry.cache import CacheEngine
from kvferry.cache.call_options import TransferOptions
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.memory import HostPool
from kvferry.transfer import Direction, transfer

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
CHUNK = 256
BS = 16
LOOKUP_CHUNKS = 512
REQUEST_CHUNKS = (1, 16, 64)
# Small objects (2 x 4 layers x 256 tokens x 64 wide, bf16: 256 KiB) keep the copy short, so the
# subtraction that isolates the cache's own time is not lost in the copy's noise.
DIMS = ModelDims(nl=4, nh=2, hs=32)

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench cache                          # 50 repeats per case
  kvferry bench cache --repeats 30 --json bench-out/cache.json
"""


def _engine(pool: HostPool) -> CacheEngine:
    return CacheEngine(KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK}}), pool=pool)


def bench_lookup(repeats: int, steps: Steps) -> dict[str, float]:
    paged = make_paged(FMT, DIMS, num_blocks=CHUNK // BS, block_size=BS, dtype=torch.bfloat16)
    # The index is what lookup reads: fill it through the public API with 512 small-model objects.
    pool = HostPool(600 * 4 * 2 * CHUNK * 64 * 2, pin=False)
    tokens = np.random.default_rng(0).integers(0, 150_000, size=LOOKUP_CHUNKS * CHUNK, dtype=np.int64)
    with _engine(pool) as engine:
        engine.namespace = engine.namespace_for("bench", FMT, paged)
        geom = describe(FMT, paged)
        for c in range(LOOKUP_CHUNKS):  # chunk by chunk, reusing the engine blocks of one chunk
            ids = [0] * (c * CHUNK // BS) + list(range(CHUNK // BS))
            engine.store(tokens[: (c + 1) * CHUNK], paged, ids, FMT, geometry=geom, skip_prefix_tokens=c * CHUNK)
        if engine.lookup(tokens) != LOOKUP_CHUNKS * CHUNK:
            raise BenchError(f"a lookup of the {LOOKUP_CHUNKS} chunks just stored did not hit them all")
        steps.done(f"index of {LOOKUP_CHUNKS} chunks filled")
        as_list, as_tensor = tokens.tolist(), torch.from_numpy(tokens)
        missing = tokens.copy()
        missing[0] += 1
        cases: dict[str, Callable[[], Any]] = {
            "lookup_128k_numpy_us": lambda: engine.lookup(tokens),
            "lookup_128k_tensor_us": lambda: engine.lookup(as_tensor),
            "lookup_128k_list_us": lambda: engine.lookup(as_list),
            "lookup_128k_locked_us": lambda: engine.free_lookup_locks(
                engine.lookup_status(tokens, lock=True).lock_id or 0
            ),
            "lookup_miss_us": lambda: engine.lookup(missing),
        }
        result = {}
        for name, case in cases.items():
            result[name] = median_us(case, repeats)
            steps.done(name.removesuffix("_us"))
        return result


def bench_overhead(n_chunks: int, repeats: int, with_geometry: bool, steps: Steps) -> dict[str, Any]:
    """Bare transfer and API call alternate, so both see the same machine load.

    Two estimates of the cache's own time per chunk: `interleaved` = (API - bare) from alternating runs
    (min and median over runs), and `in_call` = API wall time minus the time the engine itself spent inside
    its transfer call in that same call (median; immune to run-to-run noise in the copy).
    """
    n_blocks = n_chunks * CHUNK // BS
    paged = make_paged(FMT, DIMS, num_blocks=n_blocks + 8, block_size=BS, dtype=torch.bfloat16)
    geom = describe(FMT, paged)
    shape = geom.object_shape(CHUNK)
    obj_bytes = int(np.prod(shape)) * 2
    pool = HostPool(2 * (n_chunks + 1) * (obj_bytes + 4096) // 4096 * 4096, pin=False)
    ids = torch.randperm(n_blocks + 8)[:n_blocks].tolist()
    rng = np.random.default_rng(1)
    kwargs: TransferOptions = {"geometry": geom} if with_geometry else {}
    samples: dict[str, list[float]] = {k: [] for k in ("bare_d2h", "store", "store_in", "bare_h2d", "retr", "retr_in")}
    label = f"{n_chunks}-chunk requests, geometry {'given' if with_geometry else 'per call'}"
    with _engine(pool) as engine:
        engine.namespace = engine.namespace_for("bench", FMT, paged)
        objects = [pool.alloc(shape, torch.bfloat16) for _ in range(n_chunks)]
        counters = engine.counters
        for i in range(repeats + 1):
            tokens = rng.integers(0, 150_000, size=n_chunks * CHUNK, dtype=np.int64)
            bare_d2h = elapsed_us(
                lambda: transfer(paged, objects, ids, Direction.D2H, FMT, chunk_size=CHUNK, geometry=geom)
            )
            inside = counters.store_seconds
            store = elapsed_us(functools.partial(engine.store, tokens, paged, ids, FMT, **kwargs))
            store_in = store - (counters.store_seconds - inside) * 1e6
            bare_h2d = elapsed_us(
                lambda: transfer(paged, objects, ids, Direction.H2D, FMT, chunk_size=CHUNK, geometry=geom)
            )
            inside = counters.retrieve_seconds
            retr = elapsed_us(functools.partial(engine.retrieve, tokens, paged, ids, FMT, **kwargs))
            retr_in = retr - (counters.retrieve_seconds - inside) * 1e6
            engine.clear()
            if i:  # the first round warms plan caches
                for name, value in zip(samples, (bare_d2h, store, store_in, bare_h2d, retr, retr_in), strict=True):
                    samples[name].append(value)
    steps.done(label)  # after the rounds, not between them: drawing the bar would disturb the next round
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per case; medians (default: %(default)s)")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "repeats")


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    configs = [(n, g) for g in (True, False) for n in REQUEST_CHUNKS]
    steps.expect(2 + 5 + len(configs))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cache's own Python is what is measured; one thread keeps the copies steady
    try:
        calibration = calibration_s()
        steps.done("calibration")
        lookup = bench_lookup(args.repeats, steps)
        overhead = [bench_overhead(n, args.repeats, g, steps) for n, g in configs]
    finally:
        torch.set_num_threads(threads)
    results = {"calibration_10M_steps_s": calibration, "lookup": lookup, "overhead": overhead}
    config = {"repeats": args.repeats, "chunk_size": CHUNK, "block_size": BS, "format": FMT.name, "torch_threads": 1}
    return Outcome(config, results, _show(calibration, lookup, overhead))


def _show(calibration: float, lookup: dict[str, float], overhead: list[dict[str, Any]]) -> list[Any]:
    lookups = new_table(f"CacheEngine.lookup, {LOOKUP_CHUNKS} chunks of {CHUNK} tokens", ("lookup case", "median us"))
    for name, value in lookup.items():
        lookups.add_row(name, f"{value:.1f}")
    per_chunk = new_table(
        "cache overhead per chunk, us (interleaved min / interleaved median / in-call median)",
        ("chunks", "geometry", "bare store", "api store", "store ovh/chunk", "bare retr", "api retr", "retr ovh/chunk"),
        names=2,
    )
    for row in overhead:
        so, ro = row["store_overhead_per_chunk_us"], row["retrieve_overhead_per_chunk_us"]
        per_chunk.add_row(
            str(row["chunks"]),
            "given" if row["geometry_given"] else "per call",
            f"{row['bare_store_us']:.1f}",
            f"{row['api_store_us']:.1f}",
            f"{so['interleaved_min']:.1f} / {so['interleaved_median']:.1f} / {so['in_call_median']:.1f}",
            f"{row['bare_retrieve_us']:.1f}",
            f"{row['api_retrieve_us']:.1f}",
            f"{ro['interleaved_min']:.1f} / {ro['interleaved_median']:.1f} / {ro['in_call_median']:.1f}",
        )
    busy = f"calibration: 10M interpreter steps took {calibration:.2f} s (about 0.4 s on an idle machine)"
    return [busy, lookups, per_chunk]
