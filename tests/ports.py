"""Loopback ports for the tests."""

from __future__ import annotations

import socket

from kvferry.bench.ports import ports_bound_later


def free_port() -> int:
    """A loopback port free now, for a server started right away."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_for_a_restart() -> int:
    """A free loopback port for a server that is down while a client waits for it (one that starts late, or
    restarts): see `ports_bound_later`. Seen in CI: a client stayed up through such a restart, as one answered by
    something else would."""
    return ports_bound_later()[0]
