"""Where clients reach the server: its TCP port, and a Unix socket beside it; an error names which one failed."""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat

import zmq

from kvferry.config import SecurityConfig, ServerConfig
from kvferry.server.unix_clients import listen


class ServerStartError(OSError):
    """The server could not open one of its ports; the message names which one and why."""


def bind_clients(
    router: zmq.Socket, config: ServerConfig, security: SecurityConfig
) -> tuple[int, socket.socket | None]:
    """Bind `router` to the configured TCP port (0: a free one) and listen on the Unix socket (served without ZMQ:
    `kvferry.server.unix_clients`; its file given `security`'s mode and group); returns the TCP port and the Unix
    listener (None without one). ServerStartError, naming the endpoint, if either cannot be bound."""
    host, port = config.host, config.port
    try:
        if port == 0:
            port = router.bind_to_random_port(f"tcp://{host}")
        else:
            router.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as exc:
        raise ServerStartError(f"cannot listen for clients on tcp://{host}:{config.port}: {exc}") from exc
    if config.ipc_path is None:
        return port, None
    try:
        _check_ipc_path(config.ipc_path)
        gid = _group_id(security.ipc_group)
        return port, listen(config.ipc_path, security.ipc_mode_bits, gid)
    except KeyError as exc:
        raise ServerStartError(f"security.ipc_group={security.ipc_group}: {exc.args[0]}") from None
    except OSError as exc:
        raise ServerStartError(f"cannot listen for clients on ipc://{config.ipc_path}: {exc}") from exc


def _group_id(group: str | None) -> int | None:
    """The id of group `group` (a name or a number); KeyError saying so if there is none such."""
    if group is None:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise KeyError(f"no group {group!r} on this machine") from None


def remove_ipc_socket(path: str) -> None:
    """The server's Unix socket file, removed once it is closed (closing a socket leaves its file behind)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _check_ipc_path(path: str) -> None:
    """Refuse a Unix socket path that is not free: binding deletes whatever is there, a live server's socket
    (which then loses every new client to this one) or any other file. A socket nobody listens on is left over by a
    server that died: that one is taken over."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return  # stale
    raise FileExistsError(f"another process (a running kvferry server?) listens on {path}")
