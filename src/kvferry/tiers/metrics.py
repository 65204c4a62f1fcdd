"""Tier metrics: plain per-tier counts, exported to Prometheus by a collector over any set of tiers.

Nothing goes to prometheus_client's global registry: a process holding two caches (or a server and a test) would
mix their tiers there, and a server exports only the registry it builds. Each tier has a registry of its own
(`Tier.metrics_registry`); a cache engine's registry holds one collector over all of its tiers, labelled by tier.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter as _Counts
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

OPS_HELP = (
    "Tier operations by outcome. put: stored|exists|full|unavailable|error; "
    "get: hit|miss|corrupt|no_memory|unavailable|error; contains/delete: ok|unavailable|error"
)
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class TierMetrics:
    """One tier's counts (thread-safe): what `Tier.stats()` reports and what `TierCollector` exports."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._ops: _Counts[tuple[str, str]] = _Counts()
        self._bytes: _Counts[str] = _Counts()
        self._seconds: dict[str, tuple[list[int], list[float]]] = {}  # op -> (per-bucket counts, [sum])
        self.evictions = 0
        self.healthy = True
        self.used_bytes: int | None = None
        self.capacity_bytes: int | None = None

    def op(self, op: str, result: str, nbytes: int = 0, seconds: float | None = None) -> None:
        with self._lock:
            self._ops[op, result] += 1
            if nbytes:
                self._bytes[op] += nbytes
            if seconds is not None:
                counts, total = self._seconds.setdefault(op, ([0] * (len(BUCKETS) + 1), [0.0]))
                counts[bisect_left(BUCKETS, seconds)] += 1  # bucket i holds BUCKETS[i-1] < s <= BUCKETS[i]
                total[0] += seconds

    def evicted(self, count: int) -> None:
        with self._lock:
            self.evictions += count

    def set_healthy(self, healthy: bool) -> None:
        self.healthy = healthy

    def set_usage(self, used: int | None, capacity: int | None) -> None:
        self.used_bytes, self.capacity_bytes = used, capacity

    def count(self, op: str, result: str) -> int:
        with self._lock:
            return self._ops[op, result]

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            ops: dict[str, dict[str, int]] = {}
            for (op, result), n in sorted(self._ops.items()):
                ops.setdefault(op, {})[result] = n
            return {"ops": ops, "bytes": dict(self._bytes), "evictions": self.evictions}

    def _families_data(self) -> tuple[dict, dict, dict, int]:
        with self._lock:
            seconds = {op: (list(counts), total[0]) for op, (counts, total) in self._seconds.items()}
            return dict(self._ops), dict(self._bytes), seconds, self.evictions


class TierCollector(Collector):
    """The `kvferry_tier_*` families of every tier ``metrics()`` returns (called on each scrape)."""

    def __init__(self, metrics: Callable[[], Iterable[TierMetrics]]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        ops = CounterMetricFamily("kvferry_tier_ops", OPS_HELP, labels=["tier", "op", "result"])
        nbytes = CounterMetricFamily(
            "kvferry_tier_bytes", "Payload bytes of the objects a tier stored or returned", labels=["tier", "op"]
        )
        seconds = HistogramMetricFamily(
            "kvferry_tier_op_seconds",
            "Wall time of a tier put/get in a worker (queueing excluded)",
            labels=["tier", "op"],
        )
        evictions = CounterMetricFamily(
            "kvferry_tier_evictions", "Objects a tier evicted to make room", labels=["tier"]
        )
        healthy = GaugeMetricFamily(
            "kvferry_tier_healthy", "1 while the tier is healthy, 0 while it is skipped and probed", labels=["tier"]
        )
        used = GaugeMetricFamily(
            "kvferry_tier_used_bytes", "Bytes a tier holds (as last seen by this process)", labels=["tier"]
        )
        capacity = GaugeMetricFamily(
            "kvferry_tier_capacity_bytes", "A tier's capacity limit (absent when unbounded)", labels=["tier"]
        )
        for tier in self._metrics():
            counts, bytes_by_op, times, evicted = tier._families_data()
            name = tier.tier
            for (op, result), n in sorted(counts.items()):
                ops.add_metric([name, op, result], n)
            for op, n in sorted(bytes_by_op.items()):
                nbytes.add_metric([name, op], n)
            for op, (per_bucket, total) in sorted(times.items()):
                cumulative, running = [], 0
                for bound, n in zip((*map(str, BUCKETS), "+Inf"), per_bucket, strict=True):
                    running += n
                    cumulative.append((bound, running))
                seconds.add_metric([name, op], cumulative, total)
            evictions.add_metric([name], evicted)
            healthy.add_metric([name], 1 if tier.healthy else 0)
            if tier.used_bytes is not None:
                used.add_metric([name], tier.used_bytes)
            if tier.capacity_bytes is not None:
                capacity.add_metric([name], tier.capacity_bytes)
        yield from (ops, nbytes, seconds, evictions, healthy, used, capacity)


def tier_registry(metrics: Callable[[], Iterable[TierMetrics]]) -> CollectorRegistry:
    """A registry holding the `kvferry_tier_*` families of the tiers ``metrics()`` returns."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TierCollector(metrics))
    return registry
