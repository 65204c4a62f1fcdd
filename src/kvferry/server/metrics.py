"""The server's own Prometheus metrics (requests, latency, sessions), in a registry per server instance."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets from 50 us (a PING on loopback) to 10 s (a large transfer behind a busy pool).
_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ServerMetrics:
    """One registry per server so tests can run several servers in one process without name clashes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvferry_server_requests",
            "requests answered, by op and outcome (ok or an error code)",
            ["op", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvferry_server_request_seconds",
            "time from receiving a request to queueing its reply",
            ["op"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
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
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}  # labels() is slow next to a PING

    def record(self, op: str, status: str, seconds: float | None) -> None:
        """Count one answered request, and its latency when it got as far as running."""
        children = self._children.get((op, status))
        if children is None:
            children = self._children[(op, status)] = (self.requests.labels(op, status), self.latency.labels(op))
        children[0].inc()
        if seconds is not None:
            children[1].observe(seconds)
