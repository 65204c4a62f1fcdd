"""File descriptors from a client to the server: the server's second Unix socket (``<--ipc PATH>.fds``,
SOCK_SEQPACKET), beside the request socket, since ZMQ and the framed request stream carry bytes only.

A deposit is one connection: the client sends messages of up to `MAX_FDS_PER_MESSAGE` descriptors each
(SCM_RIGHTS), every message a msgpack map ``{"total": N}`` naming how many the whole deposit holds; once N have come
the server answers ``{"token": <16 bytes>}`` (or ``{"error": "..."}``) and closes the connection. A registration then
names the token and each descriptor's index in the deposit (`kvferry.server.requests.CudaVmmStorage`). SOCK_SEQPACKET
keeps each message whole with its descriptors: no framing, and a peer that dies mid-deposit leaves only whole
messages behind, whose descriptors the server closes.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import msgpack

MAX_FDS_PER_MESSAGE = 250  # Linux takes at most 253 (SCM_MAX_FD) in one message
MAX_FDS_PER_DEPOSIT = 4096  # a registration's storages (`RegisterArgs.storages`)
MAX_MESSAGE_BYTES = 256  # a deposit's maps are a few bytes; more is refused, never read in part
TOKEN_BYTES = 16


class FdPassingError(ValueError):
    """A deposit that cannot be read: malformed, oversized, or cut short."""


def fd_socket_path(ipc_path: str) -> str:
    """The descriptor socket of a server whose request socket is `ipc_path`."""
    return ipc_path + ".fds"


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors it carried, which the caller then owns (closed here if the message is
    refused). An empty map and no descriptors at the end of the stream."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES + 1, MAX_FDS_PER_MESSAGE + 1)
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE_BYTES:
            raise FdPassingError(f"a message over {MAX_MESSAGE_BYTES} bytes or {MAX_FDS_PER_MESSAGE} descriptors")
        if len(fds) > MAX_FDS_PER_MESSAGE:
            raise FdPassingError(f"{len(fds)} descriptors in one message (max {MAX_FDS_PER_MESSAGE})")
        if not data:
            if fds:
                raise FdPassingError("descriptors without a message")
            return {}, []
        try:
            message = msgpack.unpackb(data, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise FdPassingError(f"a message that is not msgpack: {exc}") from None
        if not isinstance(message, dict):
            raise FdPassingError(f"a message that is a {type(message).__name__}, not a map")
        return message, fds
    except BaseException:
        close_all(fds)
        raise


def send_deposit(sock: socket.socket, fds: list[int]) -> bytes:
    """Send every descriptor of `fds` over a connected descriptor socket and return the server's token. The
    descriptors stay the caller's (the kernel passes copies)."""
    if not 1 <= len(fds) <= MAX_FDS_PER_DEPOSIT:
        raise FdPassingError(f"a deposit holds 1..{MAX_FDS_PER_DEPOSIT} descriptors, not {len(fds)}")
    header = pack({"total": len(fds)})
    with contextlib.suppress(BrokenPipeError):  # the server stopped reading: its answer says why
        for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
            socket.send_fds(sock, [header], fds[start : start + MAX_FDS_PER_MESSAGE])
    reply, extra = receive(sock)
    close_all(extra)
    token = reply.get("token")
    if isinstance(token, bytes) and len(token) == TOKEN_BYTES:
        return token
    raise FdPassingError(f"the server refused the descriptors: {reply.get('error', reply or 'no answer')}")


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):  # already closed: nothing of it is left to free
            os.close(fd)
