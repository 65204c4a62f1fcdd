"""The Mooncake rows of `kvferry bench tiers`: the tier's put / get against the raw client's on the same bytes.

Both sides move the same pool-resident objects through the same store in the same run: the tier (header +
checksum, batched `batch_put_from_multi_buffers`, a header read then `batch_get_into_multi_buffers` into the pool,
verified) and a second, raw `MooncakeDistributedStore` client of the same master doing one `batch_put_from` /
`batch_get_into` of the bytes from and into the same registered pool memory. Each pass removes what it stored.
"""

from __future__ import annotations

import time

import torch

from kvferry.bench.harness import BenchError, Steps
from kvferry.memory import HostPool
from kvferry.tiers import MooncakeTier, TierURLError, make_tier, parse_tier_url
from kvferry.tiers.mooncake_client import open_store


def check_url(url: str) -> None:
    try:
        spec = parse_tier_url(url)
    except TierURLError as exc:
        raise BenchError(f"--mooncake: {exc}") from None
    if spec.kind is not MooncakeTier:
        raise BenchError(f"--mooncake {url!r}: expected a mooncake:// URL")


def bench_mooncake(
    url: str, pool: HostPool, name: str, objs: list[torch.Tensor], reps: int, steps: Steps
) -> dict[str, list[float]]:
    """Seconds per pass: {"tier_write": [...], "tier_read": [...], "plain1_write": [...], "plain1_read": [...]}."""
    tier = make_tier(url)
    assert isinstance(tier, MooncakeTier)  # check_url made sure
    tier.use_memory(pool.slab)
    raw = open_store(tier.client_config)
    times: dict[str, list[float]] = {}
    try:
        if raw.register_buffer(pool.slab.data_ptr(), pool.slab.numel()) != 0:
            raise BenchError("the raw Mooncake client could not register the pool")
        sizes = [o.nbytes for o in objs]
        dests = [pool.alloc(tuple(o.shape), o.dtype) for o in objs]
        for rep in range(reps):
            keys = [f"bench/{name}/{rep}/{i}".encode() for i in range(len(objs))]
            start = time.perf_counter()
            stored = [f.result() for f in [tier.put(k, o) for k, o in zip(keys, objs, strict=True)]]
            times.setdefault("tier_write", []).append(time.perf_counter() - start)
            if not all(stored):
                raise BenchError(f"the Mooncake tier refused a put (stats: {tier.stats()['ops']})")
            start = time.perf_counter()
            got = [f.result() for f in [tier.get(k, pool.try_alloc) for k in keys]]
            times.setdefault("tier_read", []).append(time.perf_counter() - start)
            for g, o in zip(got, objs, strict=True):
                if g is None or not _same(g, o):
                    raise BenchError("the Mooncake tier returned wrong bytes or missed")
                pool.free(g)
            for k in keys:
                tier.delete(k)
            raw_keys = [f"raw/{name}/{rep}/{i}" for i in range(len(objs))]
            start = time.perf_counter()
            codes = raw.batch_put_from(raw_keys, [o.data_ptr() for o in objs], sizes)
            times.setdefault("plain1_write", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            read = raw.batch_get_into(raw_keys, [d.data_ptr() for d in dests], sizes)
            times.setdefault("plain1_read", []).append(time.perf_counter() - start)
            if any(codes) or read != sizes or not all(_same(d, o) for d, o in zip(dests, objs, strict=True)):
                raise BenchError(f"the raw Mooncake client failed: put {codes}, get {read}")
            raw.batch_remove(raw_keys, True)
            steps.done(f"{name}: mooncake pass {rep + 1}/{reps}")
        for dest in dests:
            pool.free(dest)
    finally:
        tier.close()
        raw.close()
    return times


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (random bf16 bits hold NaNs, which == calls unequal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
