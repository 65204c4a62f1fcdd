"""The requests a client sent and the server has not answered yet, by request id: each reply settles its request's
future (a result, `ServerError`, or `RegistrationLost` where the server no longer holds what it names); a request
past its deadline fails with TimeoutError whether or not anybody waits for it; losing the server fails them all."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvferry.client.errors import RegistrationLost, ServerError
from kvferry.protocol.messages import ErrorCode, Op, Reply

log = logging.getLogger("kvferry.client")

_LOST_CODES = frozenset({ErrorCode.UNKNOWN_REGISTRATION.value, ErrorCode.SESSION_ENDED.value})


@dataclass(slots=True)
class Pending:
    op: Op
    future: Future[Any]
    convert: Callable[[dict[str, Any]], Any]
    keepalive: Any  # objects the server reads while the request runs (a CUDA IPC event)
    deadline: float  # time.monotonic() after which nobody waits for it


class PendingRequests:
    """Guarded by `lock`, the connection's: `add` and `__bool__` are called with it held (the connection decides who
    reads replies under it too), the rest take it. Futures are completed outside it."""

    def __init__(self, lock: threading.Lock, endpoint: str, timeout_s: float) -> None:
        self._lock = lock
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._by_id: dict[int, Pending] = {}  # in the order sent: every request has the same timeout

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def add(self, request_id: int, pending: Pending) -> None:
        self._by_id[request_id] = pending

    def forget(self, request_id: int) -> None:
        """Stop waiting for a request's reply (its caller gave up); a late reply is dropped."""
        with self._lock:
            self._by_id.pop(request_id, None)

    def fail(self, request_id: int, error: Exception) -> None:
        with self._lock:
            pending = self._by_id.pop(request_id, None)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(error)

    def settle(self, replies: list[Reply]) -> None:
        for reply in replies:
            self._settle(reply)

    def _settle(self, reply: Reply) -> None:
        with self._lock:
            pending = self._by_id.pop(reply.id, None) if isinstance(reply.id, int) else None
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

    def expire(self, now: float) -> None:
        """Fail requests past their deadline (oldest first: every request has the same timeout)."""
        expired = []
        with self._lock:
            for request_id, pending in self._by_id.items():
                if pending.deadline > now:
                    break
                expired.append(request_id)
            entries = [self._by_id.pop(request_id) for request_id in expired]
        for entry in entries:
            if not entry.future.done():
                message = f"{entry.op.value}: no reply from {self._endpoint} within {self._timeout_s} s"
                entry.future.set_exception(TimeoutError(message))

    def fail_all(self, error: Exception) -> None:
        with self._lock:
            pending, self._by_id = list(self._by_id.values()), {}
        for entry in pending:
            if not entry.future.done():
                entry.future.set_exception(error)
