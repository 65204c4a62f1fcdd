"""End-to-end store/retrieve of one 256-token chunk through the CacheEngine API on a GPU engine (goal: 0.85 of memcpy).

Run on the GPU machine: PYTHONPATH=src python3 benchmarks/bench_cache_gpu.py
Wall time from the Python call to the bytes having moved, vs a single pinned memcpy of the same bytes timed
alternately with it (medians of 55).
"""

from __future__ import annotations

import statistics
import time

import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.memory import HostPool


def one_model(model: str) -> None:
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS[model], 1024, 16, device="cuda")
    geom = describe(fmt, paged)
    cache = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 2.0}}))
    ns = cache.namespace_for(model, fmt, paged, geometry=geom)
    nbytes = geom.bytes_per_token * 256
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # The cache writes a fresh pool object per chunk: a second ceiling copies into a fresh region of a pinned pool
    # each time too (the GPU's address translations for host pages are then cold, as they are for the cache).
    fresh = HostPool(61 * nbytes)
    regions = [fresh.alloc((nbytes,), torch.uint8) for _ in range(60)]
    times: dict[str, list[float]] = {k: [] for k in ("store", "retrieve", "memcpy d2h", "memcpy h2d", "fresh d2h",
                                                     "fresh h2d", "store transfer", "retrieve transfer")}  # fmt: skip

    def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        fn()
        times[name].append((time.perf_counter() - t) * 1e6)

    def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    def memcpy(to_host: bool) -> None:
        host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    for i in range(60):  # alternating with the ceiling, so both see the same machine
        tokens = list(range(i * 1000, i * 1000 + 256))
        ids = torch.randperm(1024)[:16].tolist()
        timed("memcpy d2h", lambda: memcpy(True))
        timed("fresh d2h", lambda r=regions[i]: copy_into(r, dev))
        inside = cache.counters.store_seconds
        timed("store", lambda t=tokens, b=ids: cache.store(t, paged, b, fmt, namespace=ns, geometry=geom))
        times["store transfer"].append((cache.counters.store_seconds - inside) * 1e6)
        timed("memcpy h2d", lambda: memcpy(False))
        timed("fresh h2d", lambda r=regions[(i + 30) % 60]: copy_into(dev, r))
        inside = cache.counters.retrieve_seconds
        timed("retrieve", lambda t=tokens, b=ids: cache.retrieve(t, paged, b[::-1], fmt, namespace=ns, geometry=geom))
        times["retrieve transfer"].append((cache.counters.retrieve_seconds - inside) * 1e6)
    stats = cache.stats()
    assert stats["stored_chunks"] == 60 and stats["retrieved_chunks"] == 60, stats
    med = {k: statistics.median(v[5:]) for k, v in times.items()}
    for name, d in (("store", "d2h"), ("retrieve", "h2d")):
        ours, ceil, cold = med[name], med[f"memcpy {d}"], med[f"fresh {d}"]
        inner = med[name + " transfer"]
        print(f"{model} one chunk {name} via CacheEngine: {ours:.0f} us (its transfer call {inner:.0f} us); "
              f"memcpy {ceil:.0f} us (ratio {ceil / ours:.3f}), into a fresh pool region each time {cold:.0f} us "
              f"(ratio {cold / ours:.3f}); {nbytes / 2**20:.1f} MiB", flush=True)  # fmt: skip
    cache.close()


def breakdown(model: str) -> None:
    """Where one chunk's store spends its time: the cache's steps timed by wrapping its enqueue (the writer's
    `transfer_pool_at_async`) and the handle's wait (wrappers add ~1 us), next to the bare transfer_async of the same
    chunk into a pool object. Between the two: the store's keys, index entries and eviction."""
    from kvferry import transfer_async
    from kvferry.cache import writer
    from kvferry.kernels.cuda_driver import driver
    from kvferry.transfer.handle import TransferHandle

    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, MODELS[model], 1024, 16, device="cuda")
    geom = describe(fmt, paged)
    cache = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 2.0}}))
    ns = cache.namespace_for(model, fmt, paged, geometry=geom)
    stamps: dict[str, float] = {}
    real_enqueue, real_wait = writer.transfer_pool_at_async, TransferHandle.wait

    def stamped_enqueue(*args, **kwargs):  # type: ignore[no-untyped-def]
        stamps["enter"] = time.perf_counter()
        handle = real_enqueue(*args, **kwargs)
        stamps["enqueued"] = time.perf_counter()
        return handle

    def stamped_wait(self: TransferHandle) -> None:
        stamps["wait"] = time.perf_counter()
        real_wait(self)
        stamps["waited"] = time.perf_counter()

    # The driver calls on the path to the first DMA, stamped when each returns (first of each kind per store).
    drv = driver()
    calls = {name: getattr(drv, name) for name in ("record", "htod", "wait", "launch", "dtoh")}

    def stamping(name: str, call):  # type: ignore[no-untyped-def]
        def stamped(*args):  # type: ignore[no-untyped-def]
            result = call(*args)
            stamps.setdefault("cu " + name, time.perf_counter())
            return result

        return stamped

    obj = cache.pool.alloc(geom.object_shape(256), geom.dtype)
    steps = ("before", "enqueue", "keys+index+evict", "wait", "after")
    parts: dict[str, list[float]] = {k: [] for k in (*steps, "store", "bare", *("cu " + c for c in calls))}
    writer.transfer_pool_at_async = stamped_enqueue
    TransferHandle.wait = stamped_wait  # type: ignore[method-assign]
    try:
        for i in range(60):
            tokens = list(range(i * 1000, i * 1000 + 256))
            ids = torch.randperm(1024)[:16].tolist()
            torch.cuda.synchronize()
            t = time.perf_counter()
            transfer_async(paged, [obj], ids, "D2H", fmt, geometry=geom).wait()
            parts["bare"].append((time.perf_counter() - t) * 1e6)
            stamped = i % 2 == 1  # every other store: the driver calls stamped (each wrapper adds ~1 us)
            for name, call in calls.items():
                setattr(drv, name, stamping(name, call) if stamped else call)
            stamps.clear()
            t = time.perf_counter()
            cache.store(tokens, paged, ids, fmt, namespace=ns, geometry=geom)
            end = time.perf_counter()
            for name, call in calls.items():
                setattr(drv, name, call)
            marks = [t, stamps["enter"], stamps["enqueued"], stamps["wait"], stamps["waited"], end]
            if not stamped:
                for k, a, b in zip(steps, marks[:-1], marks[1:], strict=True):
                    parts[k].append((b - a) * 1e6)
                parts["store"].append((end - t) * 1e6)
            else:
                for name in calls:
                    parts["cu " + name].append((stamps["cu " + name] - t) * 1e6)
    finally:
        writer.transfer_pool_at_async, TransferHandle.wait = real_enqueue, real_wait  # type: ignore[method-assign]
        for name, call in calls.items():
            setattr(drv, name, call)
    med = {k: statistics.median(v[5:]) for k, v in parts.items()}
    print(f"{model} one chunk store, where the time goes (us, medians; the bare wait includes its own wrapper): "
          + ", ".join(f"{k} {med[k]:.0f}" for k in (*steps, "store", "bare"))
          + "; from the call to the first driver call of each kind returning: "
          + ", ".join(f"{k} {med['cu ' + k]:.0f}" for k in calls), flush=True)  # fmt: skip
    # The same store alternated with the ceiling alone (no other kvferry call in between, unlike one_model's loop,
    # and unlike the loop above, which keeps kvferry's code and data warm in the CPU's caches for the store).
    nbytes = geom.bytes_per_token * 256
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pairs: dict[str, list[float]] = {"store": [], "memcpy": []}
    for i in range(60, 120):
        tokens = list(range(i * 1000, i * 1000 + 256))
        ids = torch.randperm(1024)[:16].tolist()
        t = time.perf_counter()
        cache.store(tokens, paged, ids, fmt, namespace=ns, geometry=geom)
        pairs["store"].append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        pairs["memcpy"].append((time.perf_counter() - t) * 1e6)
    store, ceil = (statistics.median(v[10:]) for v in pairs.values())
    print(f"{model} one chunk store alternated with the memcpy alone: {store:.0f} us, memcpy {ceil:.0f} us "
          f"(ratio {ceil / store:.3f})", flush=True)  # fmt: skip
    cache.close()


def main() -> None:
    for model in ("llama3-8b", "qwen2.5-0.5b"):
        one_model(model)
    breakdown("llama3-8b")


if __name__ == "__main__":
    main()
