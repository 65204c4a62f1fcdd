"""The Mooncake rows of `kvferry bench tiers`: the tier's put / get against the raw client's on the same bytes.

Both sides move the same pool-resident objects through the same client in the same run: the tier (headers,
batched `batch_put_from_multi_buffers`, `batch_get_into_multi_buffers` into the pool, headers checked) and the
tier's own `MooncakeDistributedStore` used raw, one `batch_put_from` / `batch_get_into` of the bytes from and into
the same registered pool memory, each object placed in the segment that holds the tier's copy (a local segment is
a memcpy, a remote one a network transfer: the two sides must not differ in that). Every read is compared with
what was written. Each pass removes what it stored.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvferry.bench.harness import BenchError, Steps
from kvferry.memory import HostPool
from kvferry.tiers import MooncakeTier, TierURLError, make_tier, parse_tier_url

POISON = 0xA5  # what read buffers hold before a read (random payloads are never all one byte)


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
    times: dict[str, list[float]] = {}
    try:
        raw = tier.store()
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
                g.view(torch.uint8).fill_(POISON)  # the next pass's reads likely land here: unread bytes show
                pool.free(g)
            segments = _segments(raw, [k.hex() for k in keys])
            for k in keys:
                tier.delete(k)
            raw_keys = [f"raw/{name}/{rep}/{i}" for i in range(len(objs))]
            start = time.perf_counter()
            codes = [0] * len(objs)
            for segment, at in segments.items():
                placed = raw.batch_put_from(
                    [raw_keys[i] for i in at], [objs[i].data_ptr() for i in at], [sizes[i] for i in at], _in(segment)
                )
                for i, code in zip(at, placed, strict=True):
                    codes[i] = code
            times.setdefault("plain1_write", []).append(time.perf_counter() - start)
            for dest in dests:
                dest.view(torch.uint8).fill_(POISON)
            start = time.perf_counter()
            read = raw.batch_get_into(raw_keys, [d.data_ptr() for d in dests], sizes)
            times.setdefault("plain1_read", []).append(time.perf_counter() - start)
            if any(codes) or read != sizes or not all(_same(d, o) for d, o in zip(dests, objs, strict=True)):
                raise BenchError(f"the raw Mooncake client failed: put {codes}, get {read}")
            if _segments(raw, raw_keys) != segments:
                raise BenchError("the raw client's objects landed in other segments than the tier's")
            raw.batch_remove(raw_keys, True)
            steps.done(f"{name}: mooncake pass {rep + 1}/{reps}")
        for dest in dests:
            pool.free(dest)
    finally:
        tier.close()
    return times


def _segments(store: Any, names: list[str]) -> dict[str, list[int]]:
    """Which segment (its node's transfer endpoint) holds each object: endpoint -> indices into ``names``."""
    where: dict[str, list[int]] = {}
    replicas = store.batch_get_replica_desc(names)
    for i, name in enumerate(names):
        if not replicas.get(name):
            raise BenchError(f"the store does not list {name}, just stored")
        where.setdefault(replicas[name][0].get_memory_descriptor().buffer_descriptor.transport_endpoint, []).append(i)
    return where


def _in(segment: str) -> Any:
    from mooncake.store import ReplicateConfig  # the wheel: check_url's tier made sure it is there

    config = ReplicateConfig()
    config.preferred_segment = segment
    return config


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (random bf16 bits hold NaNs, which == calls unequal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
