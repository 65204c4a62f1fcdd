"""The client's socket: a ZMQ DEALER owned by one background thread, requests in, futures out.

Callers on any thread queue a frame (through an inproc PUSH socket guarded by a lock) and get a
`concurrent.futures.Future`; the background thread sends it, matches replies to futures by request id and
sends heartbeats so the server keeps the session (and everything registered in it) alive.

The thread also knows whether the server can be reached, and an engine never waits on one that cannot:
- the connection starts lazily (nothing blocks); requests made before the first reply are held until the
  server answers, for at most `connect_timeout_s`;
- the server is unreachable when its connection is refused or drops, or when a heartbeat goes unanswered for
  the silence timeout. Then every waiting request fails with `ServerUnavailable`, and so does every new one at
  once, without being sent; the thread probes with a PING after 0.1 s, 0.2 s, ... up to 5 s apart (ZMQ's own
  TCP reconnects back off alike), and the first reply makes the client usable again;
- a request is sent once or not at all: the socket queues frames only on a live connection (ZMQ_IMMEDIATE), so
  nothing written while the server was away reaches it after it comes back; and every request carries a
  deadline (the client's timeout, on the server's clock) after which the server will not start it;
- a request still unanswered at its deadline fails with TimeoutError, whether or not anybody waits for it.
A server that ended this client's session (SESSION_ENDED) gets a new one under a new id; the requests of the old
one fail with `RegistrationLost`, as do requests naming a registration the server does not hold (after a
server restart, say): the caller registers its KV again.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvferry.server.protocol import (
    ErrorCode,
    Op,
    ProtocolError,
    Reply,
    decode_reply,
    decode_request,
    encode_request,
)

log = logging.getLogger("kvferry.client")

_instances = itertools.count()
_CONNECTING, _UP, _DOWN = "connecting", "up", "down"
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class ServerError(RuntimeError):
    """The server refused a request; `code` is the protocol's ErrorCode value."""

    def __init__(self, op: str, code: str, message: str) -> None:
        super().__init__(f"{op} failed: {code}: {message}")
        self.op = op
        self.code = code
        self.message = message


class RegistrationLost(ServerError):
    """The server does not hold the registration named (code UNKNOWN_REGISTRATION: it restarted, or this session
    was ended), or ended this client's session (code SESSION_ENDED). Register the KV again and use the new id."""


class ServerUnavailable(ConnectionError):
    """The server cannot be reached now; the request was not sent (or, if it was, is not waited for). The
    client keeps probing in the background and serves requests again once the server answers."""


_LOST_CODES = frozenset({ErrorCode.UNKNOWN_REGISTRATION.value, ErrorCode.SESSION_ENDED.value})


@dataclass(slots=True)
class _Pending:
    op: Op
    future: Future[Any]
    convert: Callable[[dict[str, Any]], Any]
    keepalive: Any  # objects the server reads while the request runs (a CUDA IPC event)
    deadline: float  # time.monotonic() after which nobody waits for it


class Connection:
    """One session with a server; thread-safe. `close()` fails whatever is still pending."""

    BACKOFF_S = 0.1  # first probe of an unreachable server; doubling up to BACKOFF_MAX_S
    BACKOFF_MAX_S = 5.0

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        heartbeat_interval_s: float,
        silence_timeout_s: float,
        connect_timeout_s: float = 2.0,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s  # each request's deadline
        # The deadline the server gets is a little earlier than the one this client keeps: whatever the server
        # finishes by its deadline (a store's copy of the caller's blocks, say) is done before the caller gives
        # up and reuses them, clock-offset errors included.
        self._server_wait_s = timeout_s - min(0.1, timeout_s / 10)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.silence_timeout_s = silence_timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.session_id = os.urandom(16)
        self.hello: dict[str, Any] | None = None  # the server's last PING reply (chunk size, limits)
        self.max_message_bytes: int | None = None  # the server's limit, once a PING told it
        self._clock_offset = 0.0  # server time.time() - ours, from PING replies: deadlines are in server time
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self._state = _CONNECTING
        self._since = time.monotonic()  # when the state last changed
        self._down_reason = ""
        self._up = threading.Event()
        outbox_addr = f"inproc://kvferry-client-{os.getpid()}-{next(_instances)}"
        outbox_in = self._ctx.socket(zmq.PULL)
        outbox_in.bind(outbox_addr)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.connect(outbox_addr)
        self._thread = threading.Thread(target=self._run, args=(outbox_in,), name="kvferry-client", daemon=True)
        self._thread.start()

    # -- callers' side -----------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the server answered and has not been lost since."""
        return self._state is _UP

    def wait_available(self, timeout_s: float) -> bool:
        """Block until the server answers (True) or `timeout_s` passes (False)."""
        return self._up.wait(timeout_s)

    def submit(
        self,
        op: Op,
        args: dict[str, Any],
        convert: Callable[[dict[str, Any]], Any] = lambda result: result,
        keepalive: Any = None,
    ) -> Future[Any]:
        """Queue a request; ServerUnavailable at once (nothing sent) while the server is known unreachable."""
        future: Future[Any] = Future()
        request_id = next(self._ids)
        payload = encode_request(op, request_id, args, time.time() + self._clock_offset + self._server_wait_s)
        if self.max_message_bytes is not None and len(payload) > self.max_message_bytes:
            raise ValueError(
                f"{op.value} request of {len(payload)} bytes exceeds the server's max_message_bytes="
                f"{self.max_message_bytes} (fewer tokens per request, or raise --max-message-mb)"
            )
        with self._lock:
            if self._closed:
                raise ConnectionError(f"{op.value}: the client is closed")
            if self._state is _DOWN:
                raise self._unavailable(op.value)
            self._pending[request_id] = _Pending(op, future, convert, keepalive, time.monotonic() + self.timeout_s)
            self._outbox.send(payload)
        future.request_id = request_id  # type: ignore[attr-defined]
        return future

    def forget(self, future: Future[Any]) -> None:
        """Stop waiting for `future`'s reply (after a caller's timeout); a late reply is dropped."""
        with self._lock:
            self._pending.pop(getattr(future, "request_id", -1), None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.send(b"")  # wakes the thread, which sees _closed
        self._thread.join()
        self._outbox.close(linger=0)
        self._ctx.term()
        self._fail_pending(ConnectionError("the client was closed before the server replied"))

    # -- the thread ----------------------------------------------------------------------------------------

    def _run(self, outbox_in: zmq.Socket) -> None:
        link = _Link(self)
        poller = zmq.Poller()
        poller.register(outbox_in, zmq.POLLIN)
        link.attach(poller)
        due = 0.0  # when heartbeats, probes and deadlines are looked at next (not on every request's turn)
        try:
            while not self._closed:
                wait_ms = max(1, int(min(self.heartbeat_interval_s / 4, 0.25 if self._state is _UP else 0.05) * 1e3))
                ready = dict(poller.poll(timeout=wait_ms))
                if link.monitor in ready:
                    link.on_events()
                if link.dealer in ready:
                    link.receive()
                if outbox_in in ready:
                    link.forward(outbox_in)
                if link.rotate:  # the server ended this session: what was sent in it is not coming back
                    link.detach(poller)
                    self._fail_pending(RegistrationLost("request", ErrorCode.SESSION_ENDED, "the session ended"))
                    link = _Link(self)
                    link.attach(poller)
                    due = 0.0
                now = time.monotonic()
                if now >= due:
                    due = now + 0.01
                    link.tick(now)
                    self._expire_pending(now)
        finally:
            link.detach(poller)
            outbox_in.close(linger=0)

    def _set_state(self, state: str, reason: str = "") -> None:
        """Enter `state`; going down fails every request still waiting (they cannot be answered now)."""
        with self._lock:
            previous, self._state = self._state, state
            self._since = time.monotonic()
            self._down_reason = reason
        if state is _UP:
            self._up.set()
            if previous is _DOWN:
                log.info("kvferry server %s is reachable again", self.endpoint)
            return
        self._up.clear()
        if state is _DOWN:
            if previous is not _DOWN:
                log.warning(
                    "kvferry server %s is unreachable (%s); requests fail until it answers", self.endpoint, reason
                )
            self._fail_pending(self._unavailable("the request"))

    def _unavailable(self, what: str) -> ServerUnavailable:
        return ServerUnavailable(f"{what}: kvferry server {self.endpoint} is unreachable ({self._down_reason})")

    def _settle(self, reply: Reply) -> None:
        with self._lock:
            pending = self._pending.pop(reply.id, None) if isinstance(reply.id, int) else None
        if pending is None:
            if not reply.ok and reply.error_code != ErrorCode.SESSION_ENDED:
                log.warning("server error without a waiting request: %s %s", reply.error_code, reply.error_message)
            return
        if not reply.ok:
            kind = RegistrationLost if reply.error_code in _LOST_CODES else ServerError
            pending.future.set_exception(kind(pending.op.value, reply.error_code, reply.error_message))
            return
        try:
            pending.future.set_result(pending.convert(reply.result))
        except Exception as exc:  # a reply missing a field: report it on the future, keep the thread
            pending.future.set_exception(exc)

    def _fail(self, request_id: int, error: Exception) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(error)

    def _expire_pending(self, now: float) -> None:
        """Fail requests past their deadline (oldest first: every request has the same timeout)."""
        expired = []
        with self._lock:
            for request_id, pending in self._pending.items():
                if pending.deadline > now:
                    break
                expired.append(request_id)
            entries = [self._pending.pop(request_id) for request_id in expired]
        for entry in entries:
            if not entry.future.done():
                message = f"{entry.op.value}: no reply from {self.endpoint} within {self.timeout_s} s"
                entry.future.set_exception(TimeoutError(message))

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for entry in pending:
            if not entry.future.done():
                entry.future.set_exception(error)

    def _on_hello(self, hello: dict[str, Any], sent_wall: float) -> None:
        self.hello = hello
        self.max_message_bytes = hello.get("max_message_bytes", self.max_message_bytes)
        self.heartbeat_interval_s = hello.get("heartbeat_interval_s", self.heartbeat_interval_s)
        self.silence_timeout_s = hello.get("heartbeat_timeout_s", self.silence_timeout_s)
        if isinstance(hello.get("time"), float):
            self._clock_offset = hello["time"] - (sent_wall + time.time()) / 2


class _Link:
    """One DEALER socket under one session id, with its monitor, heartbeats and probes (the thread's only).

    A new `_Link` (a new session id) replaces it when the server says the session ended (`rotate`)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        if conn.hello is not None:  # not the first link: the old session id is dead on the server
            conn.session_id = os.urandom(16)
        self.dealer = conn._ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, conn.session_id)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IMMEDIATE, 1)  # frames queue only on a live connection: never sent late
        self.dealer.setsockopt(zmq.RECONNECT_IVL, int(Connection.BACKOFF_S * 1e3))
        self.dealer.setsockopt(zmq.RECONNECT_IVL_MAX, int(Connection.BACKOFF_MAX_S * 1e3))
        self.monitor = self.dealer.get_monitor_socket(_EVENTS)
        self.dealer.connect(conn.endpoint)
        self.rotate = False
        self.held: list[zmq.Frame] = []  # requests made before the first reply
        self.last_heard = time.monotonic()
        self.probe_id: int | None = None  # the PING in flight (a heartbeat, or a probe while down)
        self.probe_sent = 0.0
        self.probe_wall = 0.0
        self.next_probe = 0.0  # while down: when to probe next
        self.backoff = Connection.BACKOFF_S
        conn._set_state(_CONNECTING)

    def attach(self, poller: zmq.Poller) -> None:
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)

    def detach(self, poller: zmq.Poller) -> None:
        for sock in (self.dealer, self.monitor):
            poller.unregister(sock)
        self.dealer.disable_monitor()
        self.monitor.close(linger=0)
        self.dealer.close(linger=0)
        for frame in self.held:
            self.conn._fail(_request_id(frame), ConnectionError("the client's session was replaced before it was sent"))
        self.held.clear()

    # -- events --------------------------------------------------------------------------------------------

    def on_events(self) -> None:
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            state = self.conn._state
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.probe()  # a (re)connection: is anybody answering?
            elif event == zmq.EVENT_DISCONNECTED and state is not _DOWN:
                self.down("the connection dropped")
            elif event == zmq.EVENT_CONNECT_RETRIED and state is _CONNECTING:
                self.down("connection refused")

    def receive(self) -> None:
        conn = self.conn
        while True:
            try:
                payload = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode_reply(payload)
            except ProtocolError as exc:
                log.warning("dropping an unreadable reply: %s", exc)
                continue
            self.last_heard = time.monotonic()
            if conn._state is not _UP:
                conn._set_state(_UP)
                self.flush()
            if not reply.ok and reply.error_code == ErrorCode.SESSION_ENDED:
                self.rotate = True  # the session id is dead on the server: continue under a new one
            if reply.id is not None and reply.id == self.probe_id:
                self.probe_id = None
                if reply.ok:
                    conn._on_hello(reply.result, self.probe_wall)
                continue
            conn._settle(reply)

    def forward(self, outbox_in: zmq.Socket) -> None:
        conn = self.conn
        while True:
            try:
                frame = outbox_in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if not len(frame):  # an empty frame only wakes the thread (close)
                continue
            state = conn._state
            if state is _UP:
                self.send(frame)
            elif state is _CONNECTING:
                self.held.append(frame)
            else:
                conn._fail(_request_id(frame), conn._unavailable("the request"))

    def send(self, frame: zmq.Frame) -> None:
        try:
            self.dealer.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no live connection: it is not queued for later
            failed = ServerUnavailable(f"kvferry server {self.conn.endpoint}: not connected")
            self.conn._fail(_request_id(frame), failed)
            self.down("not connected")

    def flush(self) -> None:
        held, self.held = self.held, []
        for frame in held:
            self.send(frame)

    def down(self, reason: str) -> None:
        for frame in self.held:
            self.conn._fail(_request_id(frame), ServerUnavailable(f"kvferry server {self.conn.endpoint}: {reason}"))
        self.held.clear()
        self.probe_id = None
        self.backoff = Connection.BACKOFF_S
        self.next_probe = time.monotonic() + self.backoff
        self.conn._set_state(_DOWN, reason)

    # -- time ----------------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Heartbeats while up; probes with backoff while down; a connection attempt that takes too long."""
        conn = self.conn
        state = conn._state
        if state is _CONNECTING:
            if now - conn._since > conn.connect_timeout_s:
                self.down(f"no answer within {conn.connect_timeout_s:g} s of connecting")
            elif self.probe_id is None:
                self.probe()
        elif state is _DOWN:
            if now >= self.next_probe:
                self.probe()
                self.backoff = min(self.backoff * 2, Connection.BACKOFF_MAX_S)
                self.next_probe = now + self.backoff
        elif self.probe_id is not None:
            # Judge the server by a heartbeat it has had time to answer, never by how long this thread itself
            # was kept from running (a reply that came meanwhile was read before this check).
            if self.last_heard < self.probe_sent and now - self.probe_sent > conn.silence_timeout_s:
                self.down(f"no reply for {now - self.probe_sent:.1f} s")
        elif now - self.probe_sent >= conn.heartbeat_interval_s:
            self.probe()

    def probe(self) -> None:
        """Send a PING (a heartbeat, a first handshake, or a probe of a server thought gone)."""
        probe_id = next(self.conn._ids)
        try:
            self.dealer.send(encode_request(Op.PING, probe_id, {}), zmq.NOBLOCK)
        except zmq.Again:
            return  # not connected (yet): ZMQ keeps reconnecting; the handshake event probes again
        self.probe_id, self.probe_sent, self.probe_wall = probe_id, time.monotonic(), time.time()


def _request_id(frame: zmq.Frame) -> int:
    """The id of a request frame this client encoded (read back only when it cannot be sent)."""
    return decode_request(frame.bytes).id
