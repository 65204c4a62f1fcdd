"""The server's descriptor socket (`kvferry.protocol.fd_passing`): clients of the same user deposit file
descriptors (the engine's exported KV allocations), each deposit kept under a random token until the registration
naming it takes it, or until it expires.

Every descriptor received is closed on every path: a refused or cut-short deposit at once, an expired one at the
next deposit or take, the rest when the inbox closes; a taken one by its taker. One thread serves the socket, a
connection at a time, each bounded by `DEPOSIT_TIMEOUT_S`: a deposit is a few messages from a process on this host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass

from kvferry.protocol.fd_passing import (
    MAX_FDS_PER_DEPOSIT,
    TOKEN_BYTES,
    FdPassingError,
    close_all,
    pack,
    receive,
)

log = logging.getLogger("kvferry.server")

DEPOSIT_TIMEOUT_S = 5.0  # one connection's whole deposit
DEPOSIT_TTL_S = 60.0  # from deposit to the registration that takes it
MAX_PENDING_FDS = 4 * MAX_FDS_PER_DEPOSIT  # descriptors deposited and not taken yet, all clients together
DRAIN_S = 0.5  # a refused client's messages still read before its connection closes (one client at a time is served)


@dataclass(slots=True)
class _Deposit:
    fds: list[int]
    expires: float


class FdInbox:
    """Deposits received on the descriptor socket at `path` (mode 0600: the request socket's user only)."""

    def __init__(self, path: str, mode: int = 0o600) -> None:
        self.path = path
        self._deposits: dict[bytes, _Deposit] = {}
        self._lock = threading.Lock()
        self._closed = False  # under the lock: a deposit finishing after `close` is refused, not kept
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if os.path.exists(path):
                os.unlink(path)  # beside the request socket, which `kvferry.server.ports` checked is free
            listener.bind(path)
            os.chmod(path, mode)
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="kvferry-fd-inbox", daemon=True)
        self._thread.start()

    def take(self, token: bytes) -> list[int]:
        """The descriptors of deposit `token`, now the caller's to close; KeyError if there is none (never made,
        taken, or expired)."""
        with self._lock:
            self._expire(time.monotonic())
            return self._deposits.pop(token).fds

    def pending(self) -> int:
        """Descriptors deposited and not taken (expired ones included until the next deposit or take)."""
        with self._lock:
            return sum(len(d.fds) for d in self._deposits.values())

    def close(self, timeout_s: float = DEPOSIT_TIMEOUT_S) -> None:
        """Stop serving, remove the socket file, close every descriptor not taken; waits at most `timeout_s` for a
        deposit being read (which is then refused)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._stop_w, b"x")
        self._thread.join(timeout_s)  # the thread closes the listener and the pipe as it ends
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            for deposit in self._deposits.values():
                close_all(deposit.fds)
            self._deposits.clear()

    def _serve(self) -> None:
        try:
            self._accept_until_closed()
        finally:
            self._listener.close()
            os.close(self._stop_r)
            os.close(self._stop_w)

    def _accept_until_closed(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_r in ready:
                return
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:  # out of descriptors, say: the client sees its connection closed
                log.warning("cannot accept on the descriptor socket: %s", exc)
                continue
            with conn:
                self._serve_one(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        conn.settimeout(DEPOSIT_TIMEOUT_S)
        fds: list[int] = []
        try:
            token = self._deposit(conn, fds)
        except Exception as exc:  # anything a client sent: refused, its descriptors closed, the inbox serving on
            close_all(fds)
            log.warning("descriptor deposit refused: %s", exc)
            with contextlib.suppress(OSError):  # a client that is gone has nothing to be told
                conn.sendall(pack({"error": str(exc)}))
                _drain(conn)
            return
        with contextlib.suppress(OSError):  # a client that is gone leaves its deposit to expire untaken
            conn.sendall(pack({"token": token}))

    def _deposit(self, conn: socket.socket, fds: list[int]) -> bytes:
        """Read one deposit into `fds` (which the caller closes if this raises) and keep it; its token."""
        uid = _peer_uid(conn)
        if uid != os.getuid():
            raise FdPassingError(f"the client runs as uid {uid}, the server as {os.getuid()}")
        total = None
        deadline = time.monotonic() + DEPOSIT_TIMEOUT_S
        while total is None or len(fds) < total:
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))
            message, received = receive(conn)
            fds += received
            if not message:
                raise FdPassingError(f"the client left after {len(fds)} of {total or '?'} descriptors")
            count = message.get("total")
            if not isinstance(count, int) or not 1 <= count <= MAX_FDS_PER_DEPOSIT or total not in (None, count):
                raise FdPassingError(f"'total'={count!r}: a deposit announces one count in 1..{MAX_FDS_PER_DEPOSIT}")
            if not received or len(fds) > count:
                raise FdPassingError(f"{len(fds)} descriptors after a message announcing {count}")
            total = count
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            now = time.monotonic()
            if self._closed:
                raise FdPassingError("the server is stopping")
            self._expire(now)
            held = sum(len(d.fds) for d in self._deposits.values())
            if held + len(fds) > MAX_PENDING_FDS:
                raise FdPassingError(f"{held} descriptors already wait for their registration (max {MAX_PENDING_FDS})")
            self._deposits[token] = _Deposit(list(fds), now + DEPOSIT_TTL_S)
        return token

    def _expire(self, now: float) -> None:
        for token in [t for t, d in self._deposits.items() if d.expires <= now]:
            close_all(self._deposits.pop(token).fds)


def _drain(conn: socket.socket) -> None:
    """Read (and close) what a refused client sent after the refusal's cause, until it hangs up or for at most
    `DRAIN_S`: a Unix socket closed with unread messages resets the connection, and the client would read the reset
    instead of the refusal."""
    deadline = time.monotonic() + DRAIN_S
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            message, received = receive(conn)
        except Exception:  # a malformed message, a timeout: nothing more to read
            return
        close_all(received)
        if not message:
            return


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)
