"""`kvferry bench cache-gpu`: store/retrieve of one 256-token chunk through the CacheEngine API on a GPU engine
(goal: 0.85 of memcpy).

Wall time from the Python call to the bytes having moved, vs a single pinned memcpy of the same bytes timed
alternately with it (medians of 55), for llama3-8b (32 MiB chunks) and qwen2.5-0.5b (3 MiB). Then, for llama3-8b,
where one store's time goes (the cache's steps and the first driver call of each kind, stamped from the call) next
to the bare transfer of the same chunk, and the store alternated with the memcpy alone.

Every timed store and retrieve must report the chunk's 256 tokens, and the last retrieve of each model must leave
its blocks holding the bytes of the blocks it was stored from (read before the store; the blocks filled with random
bytes before the retrieve; all outside the timed calls): a failure ends the run (`BenchError`, exit 1).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvferry.bench.block_check import ChunkCheck, check_count
from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, require_cuda
from kvferry.bench.report import new_table
from kvferry.bench.timing import PinnedCopy, elapsed_us
from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.memory import HostPool

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
R = TypeVar("R")
MODEL_NAMES = ("llama3-8b", "qwen2.5-0.5b")
STEPS = ("before", "enqueue", "keys+index+evict", "wait", "after")
DRIVER_CALLS = ("record", "htod", "wait", "launch", "dtoh")

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench cache-gpu                                 # on a machine with CUDA
  kvferry bench cache-gpu --json bench-out/cache_gpu.json
"""


def _cache_on_gpu(model: str) -> tuple[CacheEngine, Any, Any, Any]:
    paged = make_paged(FMT, MODELS[model], 1024, 16, device="cuda")
    geom = describe(FMT, paged)
    cache = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 2.0}}))
    return cache, paged, geom, cache.namespace_for(model, FMT, paged, geometry=geom)


def one_model(model: str) -> dict[str, Any]:
    cache, paged, geom, ns = _cache_on_gpu(model)
    nbytes = geom.bytes_per_token * 256
    ceiling = PinnedCopy(nbytes)
    # The cache writes a fresh pool object per chunk: a second ceiling copies into a fresh region of a pinned pool
    # each time too (the GPU's address translations for host pages are then cold, as they are for the cache).
    fresh = HostPool(61 * nbytes)
    regions = [fresh.alloc((nbytes,), torch.uint8) for _ in range(60)]
    names = ("store", "retrieve", "memcpy d2h", "memcpy h2d", "fresh d2h", "fresh h2d")
    times: dict[str, list[float]] = {k: [] for k in (*names, "store transfer", "retrieve transfer")}

    def timed(name: str, fn: Callable[[], R]) -> R:
        us, result = timed_call(fn)
        times[name].append(us)
        return result

    def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    blocks = ChunkCheck(FMT, paged, geom)
    for i in range(60):  # alternating with the ceiling, so both see the same machine
        tokens = list(range(i * 1000, i * 1000 + 256))
        ids = torch.randperm(1024)[:16].tolist()
        backwards = ids[::-1]
        last = i == 59
        timed("memcpy d2h", lambda: ceiling(to_host=True))
        timed("fresh d2h", functools.partial(copy_into, regions[i], ceiling.dev))
        if last:
            blocks.remember(ids)
        inside = cache.counters.store_seconds
        stored = timed("store", functools.partial(cache.store, tokens, paged, ids, FMT, namespace=ns, geometry=geom))
        times["store transfer"].append((cache.counters.store_seconds - inside) * 1e6)
        check_count(f"{model}: store #{i}", stored, 256)
        timed("memcpy h2d", lambda: ceiling(to_host=False))
        timed("fresh h2d", functools.partial(copy_into, ceiling.dev, regions[(i + 30) % 60]))
        if last:
            blocks.poison(backwards)
        inside = cache.counters.retrieve_seconds
        retrieve = functools.partial(cache.retrieve, tokens, paged, backwards, FMT, namespace=ns, geometry=geom)
        retrieved = timed("retrieve", retrieve)
        times["retrieve transfer"].append((cache.counters.retrieve_seconds - inside) * 1e6)
        check_count(f"{model}: retrieve #{i}", retrieved, 256)
    blocks.verify(f"{model}: retrieve #59 into the blocks it was stored from, reversed", backwards)
    stats = cache.stats()
    cache.close()
    if stats["stored_chunks"] != 60 or stats["retrieved_chunks"] != 60:
        raise BenchError(f"{model}: 60 stores and retrieves of one chunk each, but the cache counted {stats}")
    med = {k: statistics.median(v[5:]) for k, v in times.items()}
    rows = []
    for op, d in (("store", "d2h"), ("retrieve", "h2d")):
        ours, ceil, cold = med[op], med[f"memcpy {d}"], med[f"fresh {d}"]
        rows.append(
            {
                "model": model,
                "op": op,
                "us": ours,
                "transfer_call_us": med[f"{op} transfer"],
                "memcpy_us": ceil,
                "ratio": ceil / ours,
                "fresh_region_memcpy_us": cold,
                "fresh_region_ratio": cold / ours,
                "mib": nbytes / 2**20,
            }
        )
    return {"rows": rows}


def breakdown(model: str) -> dict[str, Any]:
    """Where one chunk's store spends its time: the cache's steps timed by wrapping its enqueue (the writer's
    `transfer_pool_at_async`) and the handle's wait (wrappers add ~1 us), next to the bare transfer_async of the same
    chunk into a pool object. Between the two: the store's keys, index entries and eviction."""
    from kvferry import Direction, transfer_async
    from kvferry.cache import writer
    from kvferry.cuda.driver import driver
    from kvferry.cuda.graphs import graph_calls
    from kvferry.transfer.handle import TransferHandle

    cache, paged, geom, ns = _cache_on_gpu(model)
    stamps: dict[str, float] = {}
    real_enqueue, real_wait = writer.transfer_pool_at_async, TransferHandle.wait

    def stamped_enqueue(*args: Any, **kwargs: Any) -> Any:
        stamps["enter"] = time.perf_counter()
        handle = real_enqueue(*args, **kwargs)
        stamps["enqueued"] = time.perf_counter()
        return handle

    def stamped_wait(self: TransferHandle) -> None:
        stamps["wait"] = time.perf_counter()
        real_wait(self)
        stamps["waited"] = time.perf_counter()

    # The driver calls on the path to the first DMA, stamped when each returns (first of each kind per store).
    holders: dict[str, tuple[object, str]] = {name: (driver(), name) for name in DRIVER_CALLS}
    holders["graph launch"] = (graph_calls(), "launch")
    calls = {name: getattr(*holder) for name, holder in holders.items()}

    def stamping(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def stamped(*args: Any) -> Any:
            result = call(*args)
            stamps.setdefault("cu " + name, time.perf_counter())
            return result

        return stamped

    obj = cache.pool.alloc(geom.object_shape(256), geom.dtype)
    parts: dict[str, list[float]] = {k: [] for k in (*STEPS, "store", "bare", *("cu " + c for c in calls))}
    writer.transfer_pool_at_async = stamped_enqueue
    TransferHandle.wait = stamped_wait  # type: ignore[method-assign]  # timing stamps, undone below
    try:
        for i in range(60):
            tokens = list(range(i * 1000, i * 1000 + 256))
            ids = torch.randperm(1024)[:16].tolist()
            torch.cuda.synchronize()
            t = time.perf_counter()
            transfer_async(paged, [obj], ids, Direction.D2H, FMT, geometry=geom).wait()
            parts["bare"].append((time.perf_counter() - t) * 1e6)
            stamped = i % 2 == 1  # every other store: the driver calls stamped (each wrapper adds ~1 us)
            for name, call in calls.items():
                setattr(*holders[name], stamping(name, call) if stamped else call)
            stamps.clear()
            t = time.perf_counter()
            stored = cache.store(tokens, paged, ids, FMT, namespace=ns, geometry=geom)
            end = time.perf_counter()
            check_count(f"{model}: breakdown store #{i}", stored, 256)
            for name, call in calls.items():
                setattr(*holders[name], call)
            marks = [t, stamps["enter"], stamps["enqueued"], stamps["wait"], stamps["waited"], end]
            if not stamped:
                for k, a, b in zip(STEPS, marks[:-1], marks[1:], strict=True):
                    parts[k].append((b - a) * 1e6)
                parts["store"].append((end - t) * 1e6)
            else:  # the calls this store made (a one-chunk store replays a graph: no launch, no dtoh of its own)
                for name in calls:
                    if "cu " + name in stamps:
                        parts["cu " + name].append((stamps["cu " + name] - t) * 1e6)
    finally:
        writer.transfer_pool_at_async, TransferHandle.wait = real_enqueue, real_wait  # type: ignore[method-assign]
        for name, call in calls.items():
            setattr(*holders[name], call)
    med = {k: statistics.median(v[5:]) for k, v in parts.items() if v[5:]}
    # The same store alternated with the ceiling alone (no other kvferry call in between, unlike one_model's loop,
    # and unlike the loop above, which keeps kvferry's code and data warm in the CPU's caches for the store).
    ceiling = PinnedCopy(geom.bytes_per_token * 256)
    pairs: dict[str, list[float]] = {"store": [], "memcpy": []}
    for i in range(60, 120):
        tokens = list(range(i * 1000, i * 1000 + 256))
        ids = torch.randperm(1024)[:16].tolist()
        us, stored = timed_call(functools.partial(cache.store, tokens, paged, ids, FMT, namespace=ns, geometry=geom))
        pairs["store"].append(us)
        check_count(f"{model}: store #{i} alternated with the memcpy", stored, 256)
        pairs["memcpy"].append(elapsed_us(lambda: ceiling(to_host=True)))
    store, ceil = (statistics.median(v[10:]) for v in pairs.values())
    cache.close()
    return {
        "model": model,
        "steps_us": {k: med[k] for k in (*STEPS, "store", "bare")},
        "first_driver_call_us": {k: med["cu " + k] for k in calls if "cu " + k in med},
        "alternated_with_memcpy": {"store_us": store, "memcpy_us": ceil, "ratio": ceil / store},
    }


def timed_call(fn: Callable[[], R]) -> tuple[float, R]:
    """Wall microseconds of one call of `fn` (as `elapsed_us` times it), and what it returned."""
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1e6, result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    require_cuda("this benchmark")


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(len(MODEL_NAMES) + 1)
    rows = []
    for model in MODEL_NAMES:
        rows += one_model(model)["rows"]
        steps.done(f"{model}: one chunk via CacheEngine")
    where = breakdown("llama3-8b")
    steps.done("llama3-8b: one store's breakdown")
    config = {"models": list(MODEL_NAMES), "chunk_tokens": 256, "format": FMT.name, "l1_size_gb": 2.0}
    return Outcome(config, {"rows": rows, "breakdown": where}, _show(rows, where), device="cuda")


def _show(rows: list[dict[str, Any]], where: dict[str, Any]) -> list[Any]:
    table = new_table(
        "one 256-token chunk through CacheEngine on a GPU engine, against a same-run pinned memcpy (medians of 55)",
        ("model", "op", "MiB", "us", "its transfer call us", "memcpy us", "ratio", "fresh-region memcpy us", "ratio"),
        names=2,
    )
    for r in rows:
        table.add_row(
            r["model"],
            r["op"],
            f"{r['mib']:.1f}",
            f"{r['us']:.0f}",
            f"{r['transfer_call_us']:.0f}",
            f"{r['memcpy_us']:.0f}",
            f"{r['ratio']:.3f}",
            f"{r['fresh_region_memcpy_us']:.0f}",
            f"{r['fresh_region_ratio']:.3f}",
        )
    steps = new_table(
        f"{where['model']} one chunk store, where the time goes (us, medians; the bare wait includes its wrapper)",
        ("step", "us"),
    )
    for k, v in where["steps_us"].items():
        steps.add_row(k, f"{v:.0f}")
    for k, v in where["first_driver_call_us"].items():
        steps.add_row(f"first {k} driver call returns (from the call)", f"{v:.0f}")
    alt = where["alternated_with_memcpy"]
    line = (
        f"{where['model']} one chunk store alternated with the memcpy alone: {alt['store_us']:.0f} us, "
        f"memcpy {alt['memcpy_us']:.0f} us (ratio {alt['ratio']:.3f})"
    )
    return [table, steps, line]
