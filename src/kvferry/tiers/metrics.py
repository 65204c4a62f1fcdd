"""Prometheus metrics for tiers (labelled by tier name), mirrored in per-tier counts for `Tier.stats()`."""

from __future__ import annotations

import threading
from collections import Counter as _Counts

from prometheus_client import Counter, Gauge, Histogram

OPS = Counter(
    "kvferry_tier_ops",
    "Tier operations by outcome. put: stored|exists|full|unavailable|error; "
    "get: hit|miss|corrupt|no_memory|unavailable|error; contains/delete: ok|unavailable|error",
    ["tier", "op", "result"],
)
BYTES = Counter("kvferry_tier_bytes", "Payload bytes of the objects a tier stored or returned", ["tier", "op"])
SECONDS = Histogram(
    "kvferry_tier_op_seconds",
    "Wall time of a tier put/get in a worker (queueing excluded)",
    ["tier", "op"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
EVICTIONS = Counter("kvferry_tier_evictions", "Objects a tier evicted to make room", ["tier"])
HEALTHY = Gauge("kvferry_tier_healthy", "1 while the tier is healthy, 0 while it is skipped and probed", ["tier"])
USED = Gauge("kvferry_tier_used_bytes", "Bytes a tier holds (as far as this process knows)", ["tier"])
CAPACITY = Gauge("kvferry_tier_capacity_bytes", "A tier's capacity limit (absent when unbounded)", ["tier"])


class TierMetrics:
    """One tier's view of the metrics; also keeps plain counts so stats() needs no Prometheus registry."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._ops: _Counts[tuple[str, str]] = _Counts()
        self._bytes: _Counts[str] = _Counts()
        self.evictions = 0
        HEALTHY.labels(tier).set(1)

    def op(self, op: str, result: str, nbytes: int = 0, seconds: float | None = None) -> None:
        OPS.labels(self.tier, op, result).inc()
        if nbytes:
            BYTES.labels(self.tier, op).inc(nbytes)
        if seconds is not None:
            SECONDS.labels(self.tier, op).observe(seconds)
        with self._lock:
            self._ops[op, result] += 1
            if nbytes:
                self._bytes[op] += nbytes

    def evicted(self, count: int) -> None:
        EVICTIONS.labels(self.tier).inc(count)
        with self._lock:
            self.evictions += count

    def set_healthy(self, healthy: bool) -> None:
        HEALTHY.labels(self.tier).set(1 if healthy else 0)

    def set_usage(self, used: int, capacity: int | None) -> None:
        USED.labels(self.tier).set(used)
        if capacity is not None:
            CAPACITY.labels(self.tier).set(capacity)

    def count(self, op: str, result: str) -> int:
        with self._lock:
            return self._ops[op, result]

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            ops: dict[str, dict[str, int]] = {}
            for (op, result), n in sorted(self._ops.items()):
                ops.setdefault(op, {})[result] = n
            return {"ops": ops, "bytes": dict(self._bytes), "evictions": self.evictions}
