"""The server's request counts and latency histogram, as a Prometheus scrape shows them."""

from __future__ import annotations

import sys
import threading

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvferry.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scrape_shows_counts_by_op_and_status_and_cumulative_latency_buckets() -> None:
    metrics = ServerMetrics()
    for seconds in (4e-5, 1e-4, 3e-4, 20.0):  # 1e-4 sits on a bound: counted in that bucket (le)
        metrics.record("LOOKUP", "ok", seconds)
    metrics.record("LOOKUP", "BAD_ARGUMENT", 2e-4)
    metrics.record("?", "MALFORMED", None)  # refused before it ran: counted, no latency
    samples = _samples(metrics)
    assert samples[("kvferry_server_requests_total", (("op", "LOOKUP"), ("status", "ok")))] == 4
    assert samples[("kvferry_server_requests_total", (("op", "LOOKUP"), ("status", "BAD_ARGUMENT")))] == 1
    assert samples[("kvferry_server_requests_total", (("op", "?"), ("status", "MALFORMED")))] == 1

    def bucket(le: str) -> float:
        return samples[("kvferry_server_request_seconds_bucket", (("le", le), ("op", "LOOKUP")))]

    assert [bucket(le) for le in ("5e-05", "0.0001", "0.00025", "0.0005", "10.0", "+Inf")] == [1, 2, 3, 4, 4, 5]
    assert samples[("kvferry_server_request_seconds_count", (("op", "LOOKUP"),))] == 5
    assert abs(samples[("kvferry_server_request_seconds_sum", (("op", "LOOKUP"),))] - 20.00064) < 1e-9
    assert not any(name.startswith("kvferry_server_request_seconds") and ("op", "?") in labels
                   for name, labels in samples)  # fmt: skip


def test_counts_from_several_threads_are_exact() -> None:
    metrics = ServerMetrics()

    def count() -> None:
        for _ in range(20_000):
            metrics.record("PING", "ok", 1e-4)

    threads = [threading.Thread(target=count) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: an unlocked read-modify-write loses counts
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert metrics.requests.answered("PING", "ok") == 80_000
    assert _samples(metrics)[("kvferry_server_request_seconds_count", (("op", "PING"),))] == 80_000
