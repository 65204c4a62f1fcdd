"""Loopback ports for the tests."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A loopback port free now, for a server started right away."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_for_a_restart() -> int:
    """A free loopback port below the ephemeral range, for a server that is down while a client waits for it (one
    that starts late, or restarts): there neither a port the kernel picks for another test's server or client nor
    a reconnecting client's own (Linux's TCP self-connect to a port in that range with no listener) can take it
    meanwhile. Seen in CI: a client stayed up through such a restart, as one answered by something else would."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except OSError:  # not Linux: any free port
        low = 0
    for port in [*random.sample(range(10_000, low), min(200, max(low - 10_000, 0))), 0]:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError("no free port")
