"""The server's own Prometheus metrics (requests, latency, sessions), in a registry per server instance."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets from 50 us (a PING on loopback) to 10 s (a large transfer behind a busy pool).
_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _RequestCounts(Collector):
    """Requests answered and their latencies, counted under one lock and turned into Prometheus families only
    when scraped: a labelled Counter and Histogram took 3.6 us a request against 1.3 (CPU machine), a quarter of
    a PING's own time in the server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answered: dict[tuple[str, str], int] = {}  # (op, status) -> requests
        self._latency: dict[str, list[float]] = {}  # op -> count per bucket (+Inf last), then the sum

    def record(self, op: str, status: str, seconds: float | None) -> None:
        key = (op, status)
        with self._lock:
            self._answered[key] = self._answered.get(key, 0) + 1
            if seconds is not None:
                counts = self._latency.get(op)
                if counts is None:
                    counts = self._latency[op] = [0.0] * (len(_BUCKETS) + 2)
                counts[bisect_left(_BUCKETS, seconds)] += 1
                counts[-1] += seconds

    def answered(self, op: str, status: str) -> int:
        with self._lock:
            return self._answered.get((op, status), 0)

    def by_op(self) -> dict[str, dict[str, int]]:
        """Requests answered so far: op -> outcome (ok, or an error code) -> count."""
        counts: dict[str, dict[str, int]] = {}
        with self._lock:
            for (op, status), n in sorted(self._answered.items()):
                counts.setdefault(op, {})[status] = n
        return counts

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            answered = dict(self._answered)
            latency = {op: list(counts) for op, counts in self._latency.items()}
        what = "requests answered, by op and outcome (ok or an error code)"
        requests = CounterMetricFamily("kvferry_server_requests", what, labels=["op", "status"])
        for (op, status), n in sorted(answered.items()):
            requests.add_metric([op, status], n)
        yield requests
        seconds = HistogramMetricFamily(
            "kvferry_server_request_seconds", "time from receiving a request to queueing its reply", labels=["op"]
        )
        bounds = [*map(str, _BUCKETS), "+Inf"]
        for op, counts in sorted(latency.items()):
            cumulative, total = [], 0.0
            for bound, count in zip(bounds, counts[:-1], strict=True):
                total += count
                cumulative.append((bound, total))
            seconds.add_metric([op], cumulative, sum_value=counts[-1])
        yield seconds


class ServerMetrics:
    """One registry per server so tests can run several servers in one process without name clashes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = _RequestCounts()
        self.registry.register(self.requests)
        self.sessions = Gauge("kvferry_server_sessions", "live client sessions", registry=self.registry)
        self.registrations = Gauge(
            "kvferry_server_registrations",
            "registered KV caches still mapped (including ones waiting for a transfer to finish)",
            registry=self.registry,
        )
        self.sessions_ended = Counter(
            "kvferry_server_sessions_ended",
            "sessions ended, by reason (end_session, disconnect, heartbeat, shutdown)",
            ["reason"],
            registry=self.registry,
        )

    def record(self, op: str, status: str, seconds: float | None) -> None:
        """Count one answered request, and its latency when it got as far as running."""
        self.requests.record(op, status, seconds)
