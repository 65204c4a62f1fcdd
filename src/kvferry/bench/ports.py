"""Loopback ports for servers a benchmark (or a test) starts that bind late."""

from __future__ import annotations

import random
import socket


def ports_bound_later(count: int = 1) -> list[int]:
    """``count`` distinct loopback ports free now, below the ephemeral range where there is one, for a server that
    binds them only later (vLLM's KV event publisher binds after its engine has started; a server that is down
    while a client waits for it): there no port the kernel hands another socket meanwhile (an outgoing connection,
    a server bound to port 0) nor a reconnecting client's own (Linux's TCP self-connect to a port in that range
    with no listener) can take it first. Elsewhere, any free ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except OSError:  # not Linux
        low = 0
    ports: list[int] = []
    for port in [*random.sample(range(10_000, low), min(200, max(low - 10_000, 0))), *[0] * count]:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            found = int(probe.getsockname()[1])
        if found not in ports:
            ports.append(found)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free loopback ports")
