"""Clients on this host over the server's Unix socket (`--ipc PATH`): the same msgpack frames as over ZMQ, without
ZMQ's I/O threads.

Why: ZMQ hands every message to an I/O thread on each side, so a request wakes three threads on its way in and a
reply three on its way out. On the H200 host each wake-up costs ~90-130 us; a plain stream socket read by the
server's loop thread itself is one wake-up each way (a bare round trip on the CPU machine: 21-37 us against 90-180
us through ZMQ). Engines that share a GPU's KV by CUDA IPC are on the server's host anyway.

Frames as `kvferry.protocol.unix_framing` makes them. A connection is one session: the server names it (no id
from the client to trust), and ends it when the connection closes. Everything here runs on the server's loop
thread: reads, and writes (replies of workers reach the loop as they do for ZMQ clients). Writes never block the
loop: what a client does not read waits in its connection's buffer, up to a bound past which the
client is dropped, so a client that stops reading cannot stall the others.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvferry.protocol.unix_framing import FrameTooLarge, frame, take_frames

log = logging.getLogger("kvferry.server")

_READ_BYTES = 1 << 16  # per recv call
_READS_PER_TURN = 16  # then the loop serves the others (the socket stays readable: it comes back next turn)
_UNSENT_LIMIT = 256 << 20  # replies a client has not read, beyond which it is dropped
# Plain ints: arithmetic on zmq's enum flags costs a few us a request
_POLLIN, _POLLOUT, _READ_EVENTS = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLIN | zmq.POLLERR)


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    session_id: bytes
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    blocked: bool = False  # the socket took less than the outbox: waiting to be writable (POLLOUT)


# handle(session id, request payload): replies with `UnixClients.send` (held: see there), now or from a worker
Handler = Callable[[bytes, memoryview], None]


class UnixClients:
    """The listening Unix socket and every client connected on it; owns their registrations in `poller`."""

    def __init__(self, listener: socket.socket, poller: zmq.Poller, max_message_bytes: int) -> None:
        self._listener = listener
        self._listener.setblocking(False)
        self._poller = poller
        self._max = max_message_bytes
        self._by_fd: dict[int, _Client] = {}
        self._by_session: dict[bytes, _Client] = {}
        poller.register(listener.fileno(), _POLLIN)

    def __contains__(self, session_id: bytes) -> bool:
        return session_id in self._by_session

    def serve(self, ready: dict[object, int], handle: Handler, ended: Callable[[bytes], None]) -> None:
        """Accept new clients, read and handle every whole request, flush replies: whatever `ready` says."""
        listener = self._listener.fileno()
        for fd, events in ready.items():
            if fd == listener:
                self._accept()
                continue
            client = self._by_fd.get(fd) if isinstance(fd, int) else None  # `ready` holds zmq sockets too
            if client is None:
                continue
            if events & _POLLOUT:
                self._writable(client)
            if events & _READ_EVENTS and not self._read(client, handle):
                self._drop(client)
                ended(client.session_id)

    def send(self, session_id: bytes, payload: bytes, *, hold: bool = False) -> bool:
        """Send a reply to the client of `session_id`; False if it has gone (its reply is dropped, as ZMQ does).
        `hold`: queue it, to go with the other replies to the requests read in the same batch (one system call
        for a client's 32 LOOKUPs in flight, say); they leave once the batch is handled."""
        client = self._by_session.get(session_id)
        if client is None:
            return False
        client.outbox += frame(payload)
        if len(client.outbox) > _UNSENT_LIMIT:
            log.warning("session %s dropped: %d bytes of replies unread", session_id.hex(), len(client.outbox))
            client.sock.shutdown(socket.SHUT_RDWR)  # its next read sees the end and ends the session
        elif not hold:
            self._flush(client)
        return True

    def close(self) -> list[bytes]:
        """Close every connection and the listener; the sessions that were connected."""
        sessions = list(self._by_session)
        for client in list(self._by_fd.values()):
            self._drop(client)
        self._poller.unregister(self._listener.fileno())
        self._listener.close()
        return sessions

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors, say: the client sees its connection refused or closed
                log.warning("cannot accept a client on the Unix socket: %s", exc)
                return
            sock.setblocking(False)
            client = _Client(sock, b"u" + os.urandom(15))
            self._by_fd[sock.fileno()] = client
            self._by_session[client.session_id] = client
            self._poller.register(sock.fileno(), _POLLIN)

    def _read(self, client: _Client, handle: Handler) -> bool:
        """Read what came and handle each whole request; False when the connection is over (closed, or a frame
        longer than the server takes)."""
        for _ in range(_READS_PER_TURN):
            try:
                data = client.sock.recv(_READ_BYTES)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            try:
                payloads = take_frames(client.inbox, data, self._max)
            except FrameTooLarge as exc:
                log.warning("session %s dropped: %s", client.session_id.hex(), exc)
                return False
            for payload in payloads:
                handle(client.session_id, payload)
            self._flush(client)
            if len(data) < _READ_BYTES:
                return True
        return True

    def _flush(self, client: _Client) -> None:
        if not client.outbox or client.blocked:
            return  # nothing to send, or the loop sends it once the socket is writable
        try:
            sent = client.sock.send(client.outbox)
        except BlockingIOError:
            sent = 0
        except OSError:  # gone: its read side reports it and ends the session
            client.outbox.clear()
            return
        del client.outbox[:sent]
        if client.outbox:
            client.blocked = True
            self._poller.modify(client.sock.fileno(), _POLLIN | _POLLOUT)

    def _writable(self, client: _Client) -> None:
        client.blocked = False
        self._poller.modify(client.sock.fileno(), _POLLIN)
        self._flush(client)

    def _drop(self, client: _Client) -> None:
        fd = client.sock.fileno()
        if self._by_fd.pop(fd, None) is None:
            return
        self._by_session.pop(client.session_id, None)
        self._poller.unregister(fd)
        client.sock.close()


def listen(path: str, mode: int = 0o600, gid: int | None = None) -> socket.socket:
    """A Unix stream socket listening at `path` (which `kvferry.server.ports` checked is free), its file given
    `mode` and group `gid` before it listens: nobody connects under the umask's permissions meanwhile (a socket not
    listening yet refuses every connection)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of a server that died (a live one was refused before this)
        sock.bind(path)
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
