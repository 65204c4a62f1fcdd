"""Pass an engine's exported KV allocations (file descriptors) to the server before it registers them: one deposit
on the server's descriptor socket (`kvferry.protocol.fd_passing`), which answers a token the registration names."""

from __future__ import annotations

import socket
from typing import Any

from kvferry.client.errors import ServerUnavailable
from kvferry.client.kv_export import export_kv
from kvferry.protocol.fd_passing import close_all, fd_socket_path, send_deposit

DEPOSIT_TIMEOUT_S = 5.0


def export_kv_to(endpoint: str, paged: Any) -> tuple[list[dict[str, Any]], Any]:
    """`export_kv` for the server at `endpoint`: the descriptors of driver-mapped memory deposited there, each
    such storage naming the deposit's token."""
    fds: list[int] = []
    try:
        storages, kv = export_kv(paged, fds)
        if fds:
            token = deposit_fds(endpoint, fds)
            for storage in storages:
                if storage["kind"] == "cuda_vmm_fd":
                    storage["token"] = token
    finally:
        close_all(fds)  # the server holds its own copies from the deposit on
    return storages, kv


def deposit_fds(endpoint: str, fds: list[int], timeout_s: float = DEPOSIT_TIMEOUT_S) -> bytes:
    """Send `fds` (still the caller's to close) to the server at `endpoint`; the deposit's token."""
    if not endpoint.startswith("ipc://"):
        raise ValueError(
            f"driver-mapped (VMM) GPU memory is passed to the server by file descriptor over its Unix socket: "
            f"connect to ipc://PATH (the server's --ipc PATH), not {endpoint}"
        )
    path = fd_socket_path(endpoint.removeprefix("ipc://"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            return send_deposit(sock, fds)
        except OSError as exc:  # refused, gone mid-deposit, or silent past the timeout
            raise ServerUnavailable(f"cannot pass descriptors to the server at {path}: {exc}") from exc
