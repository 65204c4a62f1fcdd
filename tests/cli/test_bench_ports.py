"""Ports for servers that bind late (vLLM's KV event publisher, a server that restarts)."""

from __future__ import annotations

import socket
import sys

import pytest

from kvferry.bench.ports import ports_bound_later


def test_ports_bound_later_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = ports_bound_later(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free
    if sys.platform == "linux":
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
        if low > 10_200:  # a range that leaves room below it
            assert all(10_000 <= port < low for port in ports)


def test_a_port_taken_meanwhile_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr("random.sample", lambda population, k: [port])  # the only candidate below the range
        assert port not in ports_bound_later(2)
