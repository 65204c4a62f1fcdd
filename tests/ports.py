"""Loopback ports for the tests."""

from __future__ import annotations

from kvferry.bench.ports import ports_bound_later


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports for servers that another process starts (the `kvferry server` CLI, a
    Mooncake master): below the ephemeral range (`ports_bound_later`), so that no socket the kernel hands out
    meanwhile (another test's connection, a server bound to port 0) takes one before that process binds it. A
    server in this process binds port 0 instead and reports the port it got."""
    return ports_bound_later(count)


def port_for_a_restart() -> int:
    """A free loopback port for a server that is down while a client waits for it (one that starts late, or
    restarts): see `ports_bound_later`. Seen in CI: a client stayed up through such a restart, as one answered by
    something else would."""
    (port,) = free_ports(1)
    return port
