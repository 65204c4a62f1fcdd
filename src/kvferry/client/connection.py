"""The client's socket: a ZMQ DEALER owned by one background thread, requests in, futures out.

Callers on any thread queue a frame (through an inproc PUSH socket guarded by a lock) and get a
`concurrent.futures.Future`; the background thread sends it, matches replies to futures by request id and
sends heartbeats so the server keeps the session (and everything registered in it) alive. If the server
stops answering for longer than its heartbeat timeout, every pending future fails with ConnectionError
rather than leaving an engine waiting forever.
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

from kvferry.server.protocol import Op, ProtocolError, decode_reply, encode_request

log = logging.getLogger("kvferry.client")

_instances = itertools.count()


class ServerError(RuntimeError):
    """The server refused a request; `code` is the protocol's ErrorCode value."""

    def __init__(self, op: str, code: str, message: str) -> None:
        super().__init__(f"{op} failed: {code}: {message}")
        self.op = op
        self.code = code
        self.message = message


@dataclass(slots=True)
class _Pending:
    op: Op
    future: Future[Any]
    convert: Callable[[dict[str, Any]], Any]
    keepalive: Any  # objects the server reads while the request runs (a CUDA IPC event)


class Connection:
    """One session with a server; thread-safe. `close()` fails whatever is still pending."""

    def __init__(self, endpoint: str, *, heartbeat_interval_s: float, silence_timeout_s: float) -> None:
        self.session_id = os.urandom(16)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.silence_timeout_s = silence_timeout_s
        self.max_message_bytes: int | None = None  # the server's limit, once the handshake told it
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, self.session_id)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        outbox_addr = f"inproc://kvferry-client-{os.getpid()}-{next(_instances)}"
        outbox_in = self._ctx.socket(zmq.PULL)
        outbox_in.bind(outbox_addr)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.connect(outbox_addr)
        self._thread = threading.Thread(target=self._run, args=(dealer, outbox_in), name="kvferry-client", daemon=True)
        self._thread.start()

    def submit(
        self,
        op: Op,
        args: dict[str, Any],
        convert: Callable[[dict[str, Any]], Any] = lambda result: result,
        keepalive: Any = None,
    ) -> Future[Any]:
        future: Future[Any] = Future()
        request_id = next(self._ids)
        payload = encode_request(op, request_id, args)
        if self.max_message_bytes is not None and len(payload) > self.max_message_bytes:
            raise ValueError(
                f"{op.value} request of {len(payload)} bytes exceeds the server's max_message_bytes="
                f"{self.max_message_bytes} (fewer tokens per request, or raise --max-message-mb)"
            )
        with self._lock:
            if self._closed:
                raise ConnectionError(f"{op.value}: the client is closed")
            self._pending[request_id] = _Pending(op, future, convert, keepalive)
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

    def _run(self, dealer: zmq.Socket, outbox_in: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(outbox_in, zmq.POLLIN)
        last_heard = time.monotonic()
        heartbeat: int | None = None  # request id of the heartbeat in flight
        heartbeat_sent = 0.0
        try:
            while not self._closed:
                ready = dict(poller.poll(timeout=max(1, int(self.heartbeat_interval_s * 250))))
                if outbox_in in ready:
                    self._forward(outbox_in, dealer)
                if dealer in ready:
                    last_heard = time.monotonic()
                    self._receive(dealer)
                now = time.monotonic()
                if heartbeat in self._pending:
                    # Judge the server by a heartbeat it has had time to answer, never by how long this
                    # thread itself was kept from running.
                    if last_heard < heartbeat_sent and now - heartbeat_sent > self.silence_timeout_s:
                        self._fail_pending(
                            ConnectionError(f"the server has not answered for {now - heartbeat_sent:.1f} s")
                        )
                elif now - heartbeat_sent >= self.heartbeat_interval_s:  # the handshake may change it
                    heartbeat = next(self._ids)
                    with self._lock:
                        self._pending[heartbeat] = _Pending(Op.PING, Future(), lambda r: r, None)
                    dealer.send(encode_request(Op.PING, heartbeat, {}))
                    heartbeat_sent = now
        finally:
            dealer.close(linger=0)
            outbox_in.close(linger=0)

    def _forward(self, outbox_in: zmq.Socket, dealer: zmq.Socket) -> None:
        while True:
            try:
                frame = outbox_in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frame):  # an empty frame only wakes the thread (close)
                dealer.send(frame, copy=False)

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                payload = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode_reply(payload)
            except ProtocolError as exc:
                log.warning("dropping an unreadable reply: %s", exc)
                continue
            with self._lock:
                pending = self._pending.pop(reply.id, None) if isinstance(reply.id, int) else None
            if pending is None:
                if not reply.ok:
                    log.warning("server error without a waiting request: %s %s", reply.error_code, reply.error_message)
                continue
            if not reply.ok:
                pending.future.set_exception(ServerError(pending.op.value, reply.error_code, reply.error_message))
                continue
            try:
                pending.future.set_result(pending.convert(reply.result))
            except Exception as exc:  # a reply missing a field: report it on the future, keep the thread
                pending.future.set_exception(exc)

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for entry in pending:
            if not entry.future.done():
                entry.future.set_exception(error)
