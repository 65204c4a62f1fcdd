"""The client's socket: a ZMQ DEALER shared by the callers' threads and one background thread; requests in, futures
out.

A caller sends its request on the socket itself (under a lock: ZMQ sockets are not thread-safe) and gets a
`concurrent.futures.Future`. A caller that then waits (`wait`) reads its own reply off the socket, and every other
reply that came with it: one caller at a time does so (the leader); others wait on their futures. The background
thread reads the replies nobody is waiting on the socket for (asynchronous requests), matches them to futures by
request id, and sends heartbeats so the server keeps the session (and everything registered in it) alive. So a
synchronous request crosses no other thread of this process (a 2-core machine: PING p50 312-424 us with every reply
read by the background thread, 275-320 us read by the caller).

The thread also knows whether the server can be reached, and an engine never waits on one that cannot:
- the connection starts lazily (nothing blocks); requests made before the first reply are held until the
  server answers, for at most `connect_timeout_s`;
- the server is unreachable when its connection is refused or drops, or when a heartbeat goes unanswered for
  the silence timeout. Then every waiting request fails with `ServerUnavailable`, and so does every new one at
  once, without being sent; the thread probes with a PING after 0.1 s, 0.2 s, ... up to 5 s apart, or half
  the server's heartbeat timeout if less (ZMQ's own TCP reconnects back off alike), and the first reply makes the
  client usable again;
- a request is sent once or not at all: the socket queues frames only on a live connection (ZMQ_IMMEDIATE), so
  nothing written while the server was away reaches it after it comes back; and every request carries a
  deadline (the client's timeout, on the server's clock) after which the server will not start it;
- a request still unanswered at its deadline fails with TimeoutError, whether or not anybody waits for it.
A server that ended this client's session (SESSION_ENDED) gets a new one under a new id; the requests of the old
one fail with `RegistrationLost`, as do requests naming a registration the server does not hold (after a
server restart, say): the caller registers its KV again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import zmq

from kvferry.client.errors import RegistrationLost, ServerUnavailable
from kvferry.client.link import CONNECTING, DOWN, UP, Link, ZmqLink
from kvferry.client.pending import Pending, PendingRequests
from kvferry.client.unix_link import UnixLink
from kvferry.protocol.messages import ErrorCode, Op, Reply, encode_request
from kvferry.security import ClientCurve
from kvferry.stopping import join_thread, term_context

log = logging.getLogger("kvferry.client")

_instances = itertools.count()
_LEADER_RECHECK_S = 0.05  # a leader also looks at its future this often (a failure set by another thread)


class Connection:
    """One session with a server; thread-safe. `close()` fails whatever is still pending."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        heartbeat_interval_s: float,
        silence_timeout_s: float,
        connect_timeout_s: float = 2.0,
        curve: ClientCurve | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve  # the keys of a CURVE handshake (ZMQ links only)
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
        self.context = zmq.Context()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the state, the pending requests, the outbox, who leads and who watches
        self._pending = PendingRequests(self._lock, endpoint, timeout_s)
        self._closed = False
        self.state = CONNECTING
        self.since = time.monotonic()  # when the state last changed
        self._down_reason = ""
        self._up = threading.Event()
        # The socket and the link's state: whoever holds this uses them (reentrant: see kvferry.client.link).
        self._socket_lock = threading.RLock()
        self._leader = threading.Lock()  # held by the caller that reads replies off the socket (see wait)
        self._leading = False  # a leader reads the socket now: the thread leaves it alone
        self._watching = False  # the thread waits on the socket's descriptor (else a sender wakes it)
        self._wake_leader_r, self._wake_leader_w = os.pipe()
        os.set_blocking(self._wake_leader_r, False)
        os.set_blocking(self._wake_leader_w, False)
        # The leader's: not select.select (an engine may hold more than FD_SETSIZE descriptors); made once
        self._leader_poller = select.poll()
        self._leader_poller.register(self._wake_leader_r, select.POLLIN)
        self._leader_watched: int | None = None  # the link descriptor registered in it
        outbox_addr = f"inproc://kvferry-client-{os.getpid()}-{next(_instances)}"
        outbox_in = self.context.socket(zmq.PULL)
        outbox_in.bind(outbox_addr)
        self._outbox = self.context.socket(zmq.PUSH)  # wakes the thread; carries requests made before an answer
        self._outbox.connect(outbox_addr)
        self._link = _new_link(self)
        self._thread = threading.Thread(target=self._run, args=(outbox_in,), name="kvferry-client", daemon=True)
        self._thread.start()

    # -- callers' side -----------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the server answered and has not been lost since."""
        return self.state is UP

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
        """Send a request; ServerUnavailable at once (nothing sent) while the server is known unreachable."""
        future: Future[Any] = Future()
        request_id = next(self._ids)
        payload = encode_request(op, request_id, args, time.time() + self._clock_offset + self._server_wait_s)
        if self.max_message_bytes is not None and len(payload) > self.max_message_bytes:
            raise ValueError(
                f"{op.value} request of {len(payload)} bytes exceeds the server's max_message_bytes="
                f"{self.max_message_bytes} (fewer tokens per request, or raise --max-message-mb)"
            )
        future.request_id = request_id  # type: ignore[attr-defined]  # read back by `forget`, with getattr
        with self._lock:
            if self._closed:
                raise ConnectionError(f"{op.value}: the client is closed")
            if self.state is DOWN:
                raise self.unavailable(op.value)
            self._pending.add(request_id, Pending(op, future, convert, keepalive, time.monotonic() + self.timeout_s))
            if self.state is not UP:  # the thread holds it until the server first answers
                self._outbox.send(payload)
                return future
            wake_thread = not self._watching and not self._leading
        with self._socket_lock:
            link = self._link
            # Not sent if it already failed (the server went down meanwhile): a request is sent once or not at all.
            if not link.closed and not future.done() and link.send(payload, request_id):
                replies = self._take_replies(link)
            else:
                replies = []
        self._pending.settle(replies)
        if wake_thread:  # it is not watching the socket: it must, for this reply
            self._poke()
        return future

    def call(self, send: Callable[[], Future[Any]]) -> Any:
        """Send a request (`send` submits it) and wait for its result, reading the reply off the socket on this
        thread unless another caller already does so; TimeoutError once the client's timeout has passed (the
        request is then forgotten)."""
        if self.state is not UP or not self._leader.acquire(blocking=False):
            return self.wait(send())
        try:
            with self._lock:  # before sending: nobody wakes the thread to read this reply
                self._leading = True
            try:
                future = send()
            except BaseException:
                self._stop_leading()
                raise
            self._lead(future)
        finally:
            self._leader.release()
        return self.wait(future)

    def wait(self, future: Future[Any]) -> Any:
        """`future`'s result; TimeoutError once the client's timeout has passed (the request is then forgotten)."""
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.forget(future)
            raise TimeoutError(f"no reply from {self.endpoint} within {self.timeout_s} s") from None

    def forget(self, future: Future[Any]) -> None:
        """Stop waiting for `future`'s reply (after a caller's timeout); a late reply is dropped."""
        self._pending.forget(getattr(future, "request_id", -1))

    def close(self, deadline: float) -> None:
        """Stop the thread and close the sockets, waiting until `deadline` (a `time.monotonic()` value) at most; a
        thread still running then (a callback of a future that does not return) keeps its sockets, left to the
        process's exit with the context."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake_thread()  # it sees _closed
        ended = join_thread(self._thread, deadline)
        self._outbox.close(linger=0)
        term_context(self.context, deadline if ended else time.monotonic())
        self._pending.fail_all(ConnectionError("the client was closed before the server replied"))
        if ended:  # else the thread may still write to them
            for fd in (self._wake_leader_r, self._wake_leader_w):
                os.close(fd)

    # -- the leader ----------------------------------------------------------------------------------------

    def _lead(self, future: Future[Any]) -> None:
        """Read replies off the socket until `future` is done or the client's timeout passes (leading)."""
        deadline = time.monotonic() + self.timeout_s
        poller = self._leader_poller
        # A level-triggered descriptor (the Unix socket's) shows a reply that came before the poll: wait first.
        # A ZMQ socket's signals an edge that the send itself may have taken: read first.
        read = not self._link.level_triggered
        try:
            while True:
                if read:
                    with self._socket_lock:
                        link = self._link
                        replies = [] if link.closed else link.receive()
                    self._pending.settle(replies)
                read = True
                link = self._link
                left = deadline - time.monotonic()
                if future.done() or left <= 0 or link.closed:
                    return
                if self._leader_watched != link.fd:  # a new link, or its connection made again
                    if self._leader_watched is not None:
                        poller.unregister(self._leader_watched)
                    poller.register(link.fd, select.POLLIN)
                    self._leader_watched = link.fd
                ready = poller.poll(min(left, _LEADER_RECHECK_S) * 1e3)
                if any(fd == self._wake_leader_r for fd, _ in ready):
                    _drain_pipe(self._wake_leader_r)
        finally:
            self._stop_leading()

    def _stop_leading(self) -> None:
        """Read what came meanwhile and hand the socket back to the thread (woken if replies are still due). A
        level-triggered descriptor still says so to the thread once it watches it: nothing to read here."""
        with self._socket_lock:
            link = self._link
            replies = [] if link.closed or link.level_triggered else link.receive()
            with self._lock:
                self._leading = False
                # replies still due, or a session the server ended (the thread replaces it)
                wake_thread = (bool(self._pending) and not self._watching) or link.rotate
        self._pending.settle(replies)
        if wake_thread:
            self._poke()

    def _take_replies(self, link: Link) -> list[Reply]:
        """After an operation on the socket (socket lock held): read what arrived, which nobody waiting on the
        descriptor would now be told of. While a leader reads, it is woken to read them itself."""
        if not self._leading:
            return link.receive()
        if link.reply_unseen():
            self._wake_leader()
        return []

    def _poke(self) -> None:
        with self._lock:
            if not self._closed:
                self._wake_thread()

    def _wake_thread(self) -> None:
        """An empty frame on the outbox (lock held). Never blocks: a full outbox wakes the thread anyway."""
        with contextlib.suppress(zmq.Again):
            self._outbox.send(b"", zmq.NOBLOCK)

    # -- the thread ----------------------------------------------------------------------------------------

    def _run(self, outbox_in: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(outbox_in, zmq.POLLIN)
        link = self._link
        if link.monitor is not None:
            poller.register(link.monitor, zmq.POLLIN)
        watched: int | None = None
        due = 0.0  # when heartbeats, probes and deadlines are looked at next (not on every request's turn)
        try:
            while not self._closed:
                with self._lock:  # a sender that sees _watching False wakes this thread (see submit)
                    watch = self.state is not UP or (bool(self._pending) and not self._leading)
                    self._watching = watch
                if (link.fd if watch else None) != watched:
                    if watched is not None:
                        poller.unregister(watched)
                    watched = link.fd if watch else None
                    if watched is not None:
                        poller.register(watched, zmq.POLLIN)
                wait_ms = max(1, int(min(self.heartbeat_interval_s / 4, 0.25 if self.state is UP else 0.05) * 1e3))
                ready = dict(poller.poll(timeout=wait_ms))
                with self._socket_lock:
                    if link.monitor is not None and link.monitor in ready:
                        link.on_events()
                    if outbox_in in ready:
                        link.forward(outbox_in)
                    now = time.monotonic()
                    ticked = now >= due
                    if ticked:
                        due = now + 0.01
                        link.tick(now)
                    replies = self._take_replies(link)
                self._pending.settle(replies)
                if link.rotate:  # the server ended this session: what was sent in it is not coming back
                    with self._socket_lock:
                        if watched is not None:
                            poller.unregister(watched)
                            watched = None
                        if link.monitor is not None:
                            poller.unregister(link.monitor)
                        link.close()
                        # Failed before the new session exists, so that no request made in it is failed.
                        ended = RegistrationLost("request", ErrorCode.SESSION_ENDED, "the session ended")
                        self._pending.fail_all(ended)
                        self._link = link = _new_link(self)
                        if link.monitor is not None:
                            poller.register(link.monitor, zmq.POLLIN)
                    due = 0.0
                if ticked:
                    self._pending.expire(now)
        finally:
            with self._socket_lock:
                link.close()
            outbox_in.close(linger=0)

    # -- requests' outcomes ----------------------------------------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def set_state(self, state: str, reason: str = "") -> None:
        """Enter `state`; going down fails every request still waiting (they cannot be answered now)."""
        with self._lock:
            previous, self.state = self.state, state
            self.since = time.monotonic()
            self._down_reason = reason
        if state is UP:
            self._up.set()
            if previous is DOWN:
                log.info("kvferry server %s is reachable again", self.endpoint)
            return
        self._up.clear()
        if state is DOWN:
            if previous is not DOWN:
                log.warning(
                    "kvferry server %s is unreachable (%s); requests fail until it answers", self.endpoint, reason
                )
            self._pending.fail_all(self.unavailable("the request"))

    def unavailable(self, what: str) -> ServerUnavailable:
        return ServerUnavailable(f"{what}: kvferry server {self.endpoint} is unreachable ({self._down_reason})")

    def on_hello(self, hello: dict[str, Any], sent_wall: float) -> None:
        self.hello = hello
        self.max_message_bytes = hello.get("max_message_bytes", self.max_message_bytes)
        self.heartbeat_interval_s = hello.get("heartbeat_interval_s", self.heartbeat_interval_s)
        self.silence_timeout_s = hello.get("heartbeat_timeout_s", self.silence_timeout_s)
        if isinstance(hello.get("session"), str):  # over the Unix socket the server names the session
            self.session_id = bytes.fromhex(hello["session"])
        if isinstance(hello.get("time"), float):
            self._clock_offset = hello["time"] - (sent_wall + time.time()) / 2

    def fail(self, request_id: int, error: Exception) -> None:
        """Fail a request the link could not send (it will get no reply)."""
        self._pending.fail(request_id, error)

    def _wake_leader(self) -> None:
        with contextlib.suppress(OSError):  # full (it is awake anyway), or closed with the client
            os.write(self._wake_leader_w, b"x")


def _drain_pipe(fd: int) -> None:
    with contextlib.suppress(OSError):  # empty (non-blocking), or closed with the client
        while os.read(fd, 64):
            pass


__all__ = ["Connection"]


def _new_link(conn: Connection) -> Link:
    """The server's Unix socket for an ``ipc://`` endpoint (no ZMQ threads: `kvferry.client.unix_link`), else ZMQ."""
    return UnixLink(conn) if conn.endpoint.startswith("ipc://") else ZmqLink(conn)
