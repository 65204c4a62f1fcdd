"""A client's link to the server under one session: its heartbeats, probes and held requests (`Link`), over a ZMQ
DEALER socket (`ZmqLink`) or the server's Unix socket (`kvferry.client.unix_link`).

Every method runs under the connection's socket lock (ZMQ sockets are not thread-safe), on the client's background
thread or on a caller's thread. Replies read are returned, not settled: the caller settles their futures once it has
released the lock. Requests that fail here (no live connection) fail at once; the lock is reentrant, so a callback
of such a future may send again.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvferry.client.errors import ServerUnavailable
from kvferry.protocol.messages import ErrorCode, Op, ProtocolError, Reply, decode_reply, decode_request, encode_request
from kvferry.security import curve_client

if TYPE_CHECKING:
    from kvferry.client.connection import Connection

log = logging.getLogger("kvferry.client")

CONNECTING, UP, DOWN = "connecting", "up", "down"
_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
_EVENTS_OPT, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum arithmetic costs a few us a request
BACKOFF_S = 0.1  # first probe of an unreachable server; doubling up to BACKOFF_MAX_S
BACKOFF_MAX_S = 5.0


class Link(ABC):
    """What every transport shares. A new link (a new session) replaces the old one when the server says the
    session ended (`rotate`). A transport provides `fd` (readable when a reply may have come), `monitor` (a ZMQ
    socket of connection events, or None), `on_events`, `payloads` (the reply frames waiting), `reply_unseen`,
    `_send` (False when there is no live connection) and `close`, and `_connect` for a probe while down."""

    fd: int
    monitor: zmq.Socket | None
    # Whether `fd` stays readable while a reply waits (a plain socket), or only signals an edge that any operation
    # on the socket may take (ZMQ's): then whoever operates on the socket reads or wakes the reader.
    level_triggered = False

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        conn.set_state(CONNECTING)  # before the new id shows: nobody takes the old session's state for the new one's
        if conn.hello is not None:  # not the first link: the old session id is dead on the server
            conn.session_id = os.urandom(16)
        self.closed = False
        self.rotate = False
        self.held: list[zmq.Frame | bytes] = []  # requests made before the first reply
        self.last_heard = time.monotonic()
        self.probe_id: int | None = None  # the PING in flight (a heartbeat, or a probe while down)
        self.probe_sent = 0.0
        self.probe_wall = 0.0
        self.next_probe = 0.0  # while down: when to probe next
        self.last_tick = time.monotonic()
        self.resumed = 0.0  # when this thread last ran again after being kept from running (see tick)
        self.backoff = BACKOFF_S

    def close(self) -> None:
        self.closed = True
        for frame in self.held:
            self.conn.fail(_request_id(frame), ConnectionError("the client's session was replaced before it was sent"))
        self.held.clear()

    @abstractmethod
    def on_events(self) -> None:
        """Read the monitor's connection events."""

    @abstractmethod
    def payloads(self) -> list[bytes | memoryview]: ...

    @abstractmethod
    def reply_unseen(self) -> bool:
        """After an operation on the socket: whether a reply waits that `fd` will not signal again (never on a
        level-triggered descriptor, which stays readable while one waits)."""

    @abstractmethod
    def _send(self, frame: zmq.Frame | bytes) -> bool: ...

    def _connect(self) -> bool:
        """Before a probe: whether a connection is there to send it on (ZMQ reconnects by itself)."""
        return True

    def receive(self) -> list[Reply]:
        """Read every reply waiting; handles the probes' and the session's own, returns the requests'."""
        conn = self.conn
        replies: list[Reply] = []
        for payload in self.payloads():
            try:
                reply = decode_reply(payload)
            except ProtocolError as exc:
                log.warning("dropping an unreadable reply: %s", exc)
                continue
            self.last_heard = time.monotonic()
            if conn.state is not UP:
                conn.set_state(UP)
                self.flush()
            if not reply.ok and reply.error_code == ErrorCode.SESSION_ENDED:
                self.rotate = True  # the session id is dead on the server: continue under a new one
            if reply.id is not None and reply.id == self.probe_id:
                self.probe_id = None
                if reply.ok:
                    conn.on_hello(reply.result, self.probe_wall)
                continue
            replies.append(reply)
        return replies

    def forward(self, outbox_in: zmq.Socket) -> None:
        """Requests queued while the server had not answered yet: hold them, send them, or fail them."""
        conn = self.conn
        while True:
            try:
                frame = outbox_in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if not len(frame):  # an empty frame only wakes the thread
                continue
            state = conn.state
            if state is UP:
                self.send(frame)
            elif state is CONNECTING:
                self.held.append(frame)
            else:
                conn.fail(_request_id(frame), conn.unavailable("the request"))

    def send(self, frame: zmq.Frame | bytes, request_id: int | None = None) -> bool:
        """Send one request; False (the request failed with ServerUnavailable) when no connection is live."""
        if not self._send(frame):  # no live connection: it is not queued for later
            failed = ServerUnavailable(f"kvferry server {self.conn.endpoint}: not connected")
            self.conn.fail(_request_id(frame) if request_id is None else request_id, failed)
            if self.conn.state is not DOWN:  # a transport that saw its connection fail went down already
                self.down("not connected")
            return False
        return True

    def flush(self) -> None:
        held, self.held = self.held, []
        for frame in held:
            self.send(frame)

    def down(self, reason: str) -> None:
        for frame in self.held:
            self.conn.fail(_request_id(frame), ServerUnavailable(f"kvferry server {self.conn.endpoint}: {reason}"))
        self.held.clear()
        self.probe_id = None
        self.backoff = BACKOFF_S
        self.next_probe = time.monotonic() + self.backoff
        self.conn.set_state(DOWN, reason)

    # -- time ----------------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Heartbeats while up; probes with backoff while down; a connection attempt that takes too long."""
        conn = self.conn
        state = conn.state
        if now - self.last_tick > conn.silence_timeout_s / 2:
            # This thread was kept from running (its process stopped or swapped; it ticks every 10-250 ms): what the
            # server sent meanwhile is not read yet. Silence is counted from now, never across the stall.
            self.resumed = now
        self.last_tick = now
        if state is CONNECTING:
            if now - max(conn.since, self.resumed) > conn.connect_timeout_s:
                self.down(f"no answer within {conn.connect_timeout_s:g} s of connecting")
            elif self.probe_id is None:
                self.probe()
        elif state is DOWN:
            if now >= self.next_probe:
                self.probe()
                # At most half the server's heartbeat timeout apart: a server back from a stall gives its sessions one
                # timeout to be heard again, and must hear this one within it.
                self.backoff = min(self.backoff * 2, BACKOFF_MAX_S, conn.silence_timeout_s / 2)
                self.next_probe = now + self.backoff
        elif self.probe_id is not None:
            # Judge the server by a heartbeat it has had time to answer since it was sent and since this thread
            # last resumed, never by how long this thread itself was kept from running.
            silent = now - max(self.probe_sent, self.resumed)
            if self.last_heard < self.probe_sent and silent > conn.silence_timeout_s:
                self.down(f"no reply for {now - self.probe_sent:.1f} s")
        elif now - self.probe_sent >= conn.heartbeat_interval_s:
            self.probe()

    def probe(self) -> None:
        """Send a PING (a heartbeat, a first handshake, or a probe of a server thought gone)."""
        if not self._connect():
            return
        probe_id = self.conn.next_id()
        if not self._send(encode_request(Op.PING, probe_id, {})):
            if self.conn.state is UP:  # a live connection takes a heartbeat: up only by a reply read after the drop
                self.down("not connected")
            return  # not connected (yet): ZMQ keeps reconnecting; the handshake event probes again
        self.probe_id, self.probe_sent, self.probe_wall = probe_id, time.monotonic(), time.time()


class ZmqLink(Link):
    """One ZMQ DEALER socket under one session id, and its monitor."""

    monitor: zmq.Socket  # always one here

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn)
        self.dealer = conn.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, conn.session_id)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IMMEDIATE, 1)  # frames queue only on a live connection: never sent late
        self.dealer.setsockopt(zmq.RECONNECT_IVL, int(BACKOFF_S * 1e3))
        self.dealer.setsockopt(zmq.RECONNECT_IVL_MAX, int(BACKOFF_MAX_S * 1e3))
        if conn.curve is not None:
            curve_client(self.dealer, conn.curve)
        # Readable when the socket may have something to read. Threads wait on this descriptor, never in a ZMQ
        # call on the socket, so one thread may use the socket while others wait; and after any operation on
        # the socket the holder reads what arrived, since that operation may have taken the descriptor's signal.
        self.fd = cast(int, self.dealer.getsockopt(zmq.FD))  # pyzmq types every option as int | bytes
        self.monitor = self.dealer.get_monitor_socket(_EVENTS)
        self.dealer.connect(conn.endpoint)

    def close(self) -> None:
        self.dealer.disable_monitor()
        self.monitor.close(linger=0)
        self.dealer.close(linger=0)
        super().close()

    def on_events(self) -> None:
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            state = self.conn.state
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.probe()  # a (re)connection: is anybody answering?
            elif event == zmq.EVENT_DISCONNECTED and state is not DOWN:
                self.down("the connection dropped")
            elif event == zmq.EVENT_CONNECT_RETRIED and state is CONNECTING:
                self.down("connection refused")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and state is not DOWN:
                self.down("the server refused this client's CURVE key")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and state is not DOWN:
                self.down("the handshake failed (CURVE keys on one side only, or the wrong server key?)")

    def payloads(self) -> list[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        while cast(int, self.dealer.getsockopt(_EVENTS_OPT)) & _POLLIN:  # cheaper than a recv raising zmq.Again
            out.append(self.dealer.recv(zmq.NOBLOCK))
        return out

    def reply_unseen(self) -> bool:
        """Whether a reply waits: an operation on the socket may have taken the descriptor's signal."""
        return bool(cast(int, self.dealer.getsockopt(_EVENTS_OPT)) & _POLLIN)

    def _send(self, frame: zmq.Frame | bytes) -> bool:
        try:
            self.dealer.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no live connection: it is not queued for later
            return False
        return True


def _request_id(frame: zmq.Frame | bytes) -> int:
    """The id of a request frame this client encoded (read back only when it cannot be sent)."""
    return decode_request(frame.bytes if isinstance(frame, zmq.Frame) else frame).id
