"""A client's link over the server's Unix socket (endpoint ``ipc://PATH``): frames as `kvferry.server.unix_clients`
reads them, no ZMQ thread on either side (why: that module).

The connection is the session: the server names it and ends it when the connection closes. A connection that drops
or is refused makes the server unreachable (`Link.down`); each probe while down connects again first, so a new
connection (a new session) follows a server restart, and requests naming registrations of the old one fail with
`RegistrationLost` as they do over ZMQ. A request is sent whole or not at all as far as the server can tell: a
send that cannot finish (the server stopped reading for `SEND_TIMEOUT_S`) closes the connection mid-frame, and the
server drops a partial frame with its connection.
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import TYPE_CHECKING

import zmq

from kvferry.client.link import Link
from kvferry.protocol.unix_framing import HEADER, frame, take_frames

if TYPE_CHECKING:
    from kvferry.client.connection import Connection

SEND_TIMEOUT_S = 5.0
_READ_BYTES = 1 << 16


class UnixLink(Link):
    """A `Link` over one connection to the server's Unix socket, made again by each probe while it is down."""

    monitor = None
    level_triggered = True

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn)
        self._path = conn.endpoint.removeprefix("ipc://")
        # Polled while there is no connection: a pipe nobody writes to (never readable).
        self._idle_r, self._idle_w = os.pipe()
        self._sock: socket.socket | None = None
        self._inbox = bytearray()
        self.fd = self._idle_r
        if self._connect():
            self.probe()  # the first handshake
        else:
            self.down("connection refused")

    def close(self) -> None:
        self._disconnect()
        os.close(self._idle_r)
        os.close(self._idle_w)
        super().close()

    def _connect(self) -> bool:
        if self._sock is not None:
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            return False
        sock.setblocking(False)
        self._sock, self.fd = sock, sock.fileno()
        self._inbox.clear()
        return True

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock, self.fd = None, self._idle_r

    def _lost(self, reason: str) -> None:
        self._disconnect()
        self.down(reason)

    def on_events(self) -> None:
        """No monitor: a connection that drops shows as the end of its stream (`payloads`)."""

    def payloads(self) -> list[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        sock = self._sock
        while sock is not None:
            try:
                data = sock.recv(_READ_BYTES)
            except BlockingIOError:
                break
            except OSError as exc:
                self._lost(f"the connection failed: {exc}")
                break
            if not data:
                self._lost("the connection dropped")
                break
            out += take_frames(self._inbox, data)
            if len(data) < _READ_BYTES:
                break
        return out

    def reply_unseen(self) -> bool:
        return False  # the socket stays readable while a reply waits

    def _send(self, request: zmq.Frame | bytes) -> bool:
        sock = self._sock
        if sock is None:
            return False
        payload = request.bytes if isinstance(request, zmq.Frame) else request
        deadline = None  # set once the socket's buffer is full: a request fits unless the server stopped reading
        try:
            # Header and payload in one call, not joined first: a STORE's 16 KB of token ids copied once less
            try:
                sent = sock.sendmsg((HEADER.pack(len(payload)), payload))
            except BlockingIOError:
                sent = 0
            if sent == HEADER.size + len(payload):
                return True
            view = memoryview(frame(payload))[sent:]  # the rest, as the server reads it (rare: a full buffer)
            while view:
                try:
                    view = view[sock.send(view) :]
                except BlockingIOError:
                    now = time.monotonic()
                    deadline = now + SEND_TIMEOUT_S if deadline is None else deadline
                    if now >= deadline or not _ready(sock, select.POLLOUT, deadline - now):
                        self._lost(f"the server read nothing for {SEND_TIMEOUT_S:g} s")
                        return False
        except OSError as exc:
            self._lost(f"the connection failed: {exc}")
            return False
        return True


def _ready(sock: socket.socket, event: int, timeout_s: float) -> bool:
    """poll, not select: an engine may hold more than FD_SETSIZE descriptors."""
    poller = select.poll()
    poller.register(sock, event)
    return bool(poller.poll(timeout_s * 1e3))
