"""Whether a request frame the socket loop received is served, and as what: the session it belongs to (opened for a
new client, refused for an ended one or for another client key), its size, its decoding, the server's state. A
frame that is not served gets its refusal's reply, counted in the server's metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

import zmq

from kvferry.config import ServerConfig
from kvferry.protocol.messages import ErrorCode, ProtocolError, Request, decode_request, encode_error
from kvferry.server.auth import RequestAuth
from kvferry.server.metrics import ServerMetrics
from kvferry.server.sessions import Session, SessionTable

log = logging.getLogger("kvferry.server")


class Admitted(NamedTuple):
    request: Request
    session: Session
    received: float  # the clock when the frame was taken up


class Admission:
    def __init__(
        self,
        config: ServerConfig,
        sessions: SessionTable,
        metrics: ServerMetrics,
        clock: Callable[[], float],
        stopping: threading.Event,
    ) -> None:
        self._config = config
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock
        self._stopping = stopping
        self.auth: RequestAuth | None = None  # CURVE on the request socket, once the server has started it

    def admit(
        self,
        identity: bytes,
        payload: memoryview | bytes,
        source: zmq.Frame | None,
        user: str | None,
        drain_disconnects: Callable[[], None],
    ) -> Admitted | bytes:
        """One request frame (from ZMQ frame `source`, or from the Unix socket: None; `user`: the client key CURVE
        authenticated it with): what to serve, or the refusal's reply. `drain_disconnects` ends the sessions whose
        connections ZMQ reported dropped, before a new client's session opens."""
        received = self._clock()
        session = self._sessions.touch(identity)
        if session is not None and session.user != user:
            # Another key under a session's id (learnt somehow): never its registrations or locks.
            log.warning("a request under session %s came with another client key: refused", identity.hex())
            return self.refuse(None, ErrorCode.SESSION_ENDED, "this session belongs to another client")
        if session is None:
            if source is not None:
                # A new client may sit on the descriptor of one that just left: end that one first (its
                # disconnect event was queued before the descriptor could be reused).
                drain_disconnects()
            if self._sessions.was_ended(identity):  # frames queued by a client that is gone: never reopen
                return self._refuse_ended(identity, payload)
            # A Unix socket client's session ends with its connection (not found by descriptor: -1).
            grants = self.auth.grants(user) if self.auth is not None and source is not None else None
            session = self._sessions.open(identity, -1 if source is None else source.get(zmq.SRCFD), user, grants)
        limit = self._config.max_message_bytes
        if len(payload) > limit:
            return self.refuse(
                None, ErrorCode.TOO_LARGE, f"request of {len(payload)} bytes exceeds max_message_bytes={limit}"
            )
        try:
            request = decode_request(payload)
        except ProtocolError as exc:
            return self.refuse(exc.request_id, exc.code, exc.message)
        if self._stopping.is_set():
            return self.refuse(request.id, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        return Admitted(request, session, received)

    def refuse(self, request_id: int | None, code: ErrorCode, message: str) -> bytes:
        self._metrics.record("?", code.value, None)
        return encode_error(request_id, code, message)

    def _refuse_ended(self, identity: bytes, payload: memoryview | bytes) -> bytes:
        request_id = None
        if len(payload) <= self._config.max_message_bytes:
            try:
                request_id = decode_request(payload).id
            except ProtocolError as exc:
                request_id = exc.request_id
        message = f"session {identity.hex()} was ended by the server; connect under a new id and register again"
        return self.refuse(request_id, ErrorCode.SESSION_ENDED, message)
