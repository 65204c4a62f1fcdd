"""The cache engine's counters, and their Prometheus view in a registry of the engine's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvferry.cache.residency import Residency

_PREFIX = "kvferry_cache"


@dataclass
class CacheCounters:
    """Monotonic counts since the engine started. Updated under the engine's lock."""

    lookups: int = 0
    hit_tokens: int = 0  # prefix tokens found in the pool by lookups
    miss_tokens: int = 0  # tokens asked for by lookups and not found in the pool
    stores: int = 0
    stored_chunks: int = 0  # objects written: full chunks and tails
    stored_tail_tokens: int = 0  # tokens stored in tail objects (partial last chunks)
    stored_bytes: int = 0
    store_seconds: float = 0.0  # time in the store transfers (D2H copies)
    present_chunks: int = 0  # chunks a store found already cached (no copy)
    skipped_chunks: int = 0  # chunks a store could not place: pool full of locked or in-use objects
    late_chunks: int = 0  # chunks whose copy ended after the store's deadline: dropped (the blocks may have changed)
    retrieves: int = 0
    retrieved_chunks: int = 0
    retrieved_bytes: int = 0
    retrieve_seconds: float = 0.0  # time in the retrieve transfers (H2D copies)
    located_chunks: int = 0  # objects handed to engines that copy them out of a shared pool themselves
    adopted_stores: int = 0  # stores an engine copied into objects reserved in a shared pool (`cache.written`)
    evictions: int = 0  # objects that left the pool to make room (dropped or written to a tier)
    evicted_bytes: int = 0
    tier_writes: int = 0  # objects written to a tier successfully
    tier_write_failures: int = 0  # tier writes that returned False (tier down or full): the object is dropped
    promotions: int = 0  # tier hits copied into the pool
    promotion_misses: int = 0  # tier reads that came back empty (absent, corrupt, pool full)
    lock_timeouts: int = 0  # lookup locks ended by their timeout rather than by a retrieve or a free
    checksum_failures: int = 0  # objects that failed verification before a retrieve: dropped, counted as misses
    expired_partial_chunks: int = 0  # objects assembled from head slices whose other slices never came: dropped


_HELP = {
    "lookups": "lookup calls",
    "hit_tokens": "prefix tokens found in the host pool by lookups",
    "miss_tokens": "tokens asked for by lookups and not found in the host pool",
    "stores": "store calls",
    "stored_chunks": "chunk objects written into the host pool by stores (tails included)",
    "stored_tail_tokens": "tokens stored in tail objects (partial last chunks)",
    "stored_bytes": "bytes copied from engines into the host pool",
    "store_seconds": "seconds spent in store copies",
    "present_chunks": "chunks a store found already cached",
    "skipped_chunks": "chunks a store skipped because the pool was full of locked or in-use objects",
    "late_chunks": "chunks a store copied after its caller stopped waiting, dropped",
    "retrieves": "retrieve calls",
    "retrieved_chunks": "chunk objects copied into engines",
    "retrieved_bytes": "bytes copied from the host pool into engines",
    "retrieve_seconds": "seconds spent in retrieve copies",
    "located_chunks": "chunk objects located for engines that copy them out of a shared host pool themselves",
    "adopted_stores": "stores engines copied themselves into objects reserved in a shared host pool",
    "evictions": "objects evicted from the host pool",
    "evicted_bytes": "bytes evicted from the host pool",
    "tier_writes": "objects written to a storage tier",
    "tier_write_failures": "tier writes that failed (tier down or full); the object was dropped",
    "promotions": "objects promoted from a storage tier into the host pool",
    "promotion_misses": "tier reads that found nothing usable",
    "lock_timeouts": "lookup locks released by their timeout",
    "checksum_failures": "objects that failed checksum verification and were dropped",
    "expired_partial_chunks": "objects assembled from tensor-parallel head slices dropped before every slice came",
    "events_dropped": "KV event records dropped because the event queue was full (a re-announcement follows)",
}

# Gauges the engine reports at collection time: name -> help.
GAUGES = {
    "pool_capacity_bytes": "host pool capacity",
    "pool_used_bytes": "host pool bytes in use",
    "pool_free_bytes": "host pool bytes free",
    "objects": "chunk objects in the host pool index (any state)",
    "cached_tokens": "tokens those objects hold (objects x chunk size): twice as many per pool byte with codec fp8",
    "locks": "active lookup locks",
    "pinned_objects": "objects held by lookup locks",
    "read_leases": "read leases of engines copying located objects themselves",
    "store_gbps": "mean store copy throughput so far, GB/s",
    "retrieve_gbps": "mean retrieve copy throughput so far, GB/s",
}


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


class _CacheCollector(Collector):
    def __init__(self, engine_label: str, snapshot: Callable[[], dict[str, float]]) -> None:
        self._label = engine_label
        self._snapshot = snapshot

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        values = self._snapshot()
        for name, help_text in _HELP.items():
            family = CounterMetricFamily(f"{_PREFIX}_{name}", help_text, labels=["engine"])
            family.add_metric([self._label], values[name])
            yield family
        for name, help_text in GAUGES.items():
            gauge = GaugeMetricFamily(f"{_PREFIX}_{name}", help_text, labels=["engine"])
            gauge.add_metric([self._label], values[name])
            yield gauge


def make_registry(engine_label: str, snapshot: Callable[[], dict[str, float]]) -> CollectorRegistry:
    """A registry of its own for one engine (engines in one process never collide), labelled ``engine``.

    ``snapshot`` returns every counter of ``CacheCounters`` and every name of ``GAUGES``; it is called on
    each scrape, so the numbers are never stale and nothing is counted twice.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_CacheCollector(engine_label, snapshot))
    return registry


def counters_dict(counters: CacheCounters) -> dict[str, float]:
    return asdict(counters)


def engine_values(res: Residency, chunk_size: int, events_dropped: int) -> dict[str, float]:
    """A cache engine's counters and every gauge of ``GAUGES`` (what `make_registry`'s snapshot returns), from its
    pool's contents ``res``."""
    with res.lock:
        values: dict[str, float] = counters_dict(res.counters)
        values["objects"] = len(res.index)
        values["cached_tokens"] = values["objects"] * chunk_size
        values["locks"] = len(res.leases)
        values["pinned_objects"] = res.leases.pinned_objects
        values["read_leases"] = res.leases.read_leases
    values["events_dropped"] = events_dropped
    pool = res.pool
    values["pool_capacity_bytes"] = pool.capacity_bytes
    values["pool_used_bytes"] = pool.used_bytes
    values["pool_free_bytes"] = pool.free_bytes
    values["store_gbps"] = gbps(values["stored_bytes"], values["store_seconds"])
    values["retrieve_gbps"] = gbps(values["retrieved_bytes"], values["retrieve_seconds"])
    assert set(GAUGES) <= set(values)
    return values
