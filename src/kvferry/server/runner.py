"""Running a parsed request, whatever transport it came on: inline on the socket thread, on a transfer worker, or
started on the socket thread and finished on a worker (a GPU transfer naming a done flag, `kvferry.server.transfers`);
its reply frame, counted in the metrics. The socket thread sends what `dispatch` returns; workers send through
`send_from_worker`. A request is not started after its deadline (the client has given up on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvferry.protocol.messages import ErrorCode, Op, ProtocolError, Request, encode_error, encode_result
from kvferry.server.handlers import INLINE_OPS, Deferred, RequestHandlers
from kvferry.server.metrics import ServerMetrics
from kvferry.server.requests import parse_args
from kvferry.server.sessions import Session
from kvferry.server.transfers import Started

log = logging.getLogger("kvferry.server")

_TRANSFER_OPS = frozenset({Op.STORE, Op.RETRIEVE})
_ON_WORKER = object()  # a transfer that _start_transfer leaves to a worker from its start
_LATE = ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the client stopped waiting before it could start")

Finish = Callable[[], None]  # the rest of a transfer started on the socket thread, for a worker


class RequestRunner:
    def __init__(
        self,
        handlers: RequestHandlers,
        metrics: ServerMetrics,
        clock: Callable[[], float],
        workers: ThreadPoolExecutor,
        tier_workers: ThreadPoolExecutor,
        send_from_worker: Callable[[bytes, bytes], None],
    ) -> None:
        self._handlers = handlers
        self._metrics = metrics
        self._clock = clock
        self._workers = workers
        self._tier_workers = tier_workers
        self._send_from_worker = send_from_worker

    def dispatch(
        self, identity: bytes, session: Session, request: Request, received: float
    ) -> tuple[bytes | None, Finish | None]:
        """Run or start `request` (on the socket thread): its reply now (None when a worker sends it), and the rest
        of a transfer started here, for a worker once the reply is sent (a worker waking meanwhile delays it)."""
        if request.op in INLINE_OPS:
            return self._run(identity, session, request, received), None
        # Only a transfer naming a done flag may start here: the others are parsed once, on their worker.
        if request.op in _TRANSFER_OPS and request.args.get("done_slot") is not None:
            started = self._start_transfer(identity, session, request, received)
            if started is not _ON_WORKER:
                return started
        self._workers.submit(self._run_on_worker, identity, session, request, received)
        return None, None

    def reply(self, request: Request, received: float, outcome: Any) -> bytes:
        """The reply frame for a handler's result, or for the exception it raised; counted in the metrics."""
        if not isinstance(outcome, BaseException):
            reply, status = encode_result(request.id, outcome), "ok"
        elif isinstance(outcome, ProtocolError):
            reply, status = encode_error(request.id, outcome.code, outcome.message), outcome.code.value
        elif isinstance(outcome, ValueError | TypeError):  # the cache engine's verdict on the arguments
            reply, status = encode_error(request.id, ErrorCode.BAD_ARGUMENT, str(outcome)), ErrorCode.BAD_ARGUMENT
        else:
            log.error("%s (request %d) failed", request.op.value, request.id, exc_info=outcome)
            reply = encode_error(request.id, ErrorCode.INTERNAL, f"{type(outcome).__name__}: {outcome}")
            status = ErrorCode.INTERNAL
        self._metrics.record(request.op.value, status, self._clock() - received)
        return reply

    def _run_on_worker(self, identity: bytes, session: Session, request: Request, received: float) -> None:
        reply = self._run(identity, session, request, received)
        if reply is not None:
            self._send_from_worker(identity, reply)

    def _run(self, identity: bytes, session: Session, request: Request, received: float) -> bytes | None:
        """Run one request; its reply, or None when its tier part was handed to the tier workers."""
        if _late(request):
            return self.reply(request, received, _LATE)

        def handle() -> Any:
            args = parse_args(request.op, request.args, request.id)
            return self._handlers.run(request.op, session, args, request.deadline)

        outcome = _attempt(handle)
        if isinstance(outcome, Deferred):
            self._tier_workers.submit(self._finish_deferred, identity, request, received, outcome)
            return None
        return self.reply(request, received, outcome)

    def _start_transfer(self, identity: bytes, session: Session, request: Request, received: float) -> Any:
        """A STORE/RETRIEVE started on this thread: (its answer now or None, its rest or None), or _ON_WORKER when it
        runs on a worker from the start."""
        if _late(request):
            return self.reply(request, received, _LATE), None

        def start() -> Started | None:
            args = parse_args(request.op, request.args, request.id)
            store = request.op is Op.STORE
            return self._handlers.transfers.start(
                session, args, store=store, deadline=request.deadline, request_id=request.id
            )

        outcome = _attempt(start)
        if outcome is None:
            return _ON_WORKER
        if isinstance(outcome, BaseException):
            return self.reply(request, received, outcome), None
        rest = None
        if outcome.finish is not None:
            rest = lambda: self._finish_transfer(identity, request, received, outcome)  # noqa: E731
        return (None if outcome.answer is None else self.reply(request, received, outcome.answer)), rest

    def _finish_transfer(self, identity: bytes, request: Request, received: float, started: Started) -> None:
        assert started.finish is not None
        outcome = _attempt(started.finish)
        if started.answer is None:
            self._send_from_worker(identity, self.reply(request, received, outcome))
        elif isinstance(outcome, BaseException):  # after the answer: the client cannot be told any more
            log.error("%s (request %d) failed after its answer", request.op.value, request.id, exc_info=outcome)

    def _finish_deferred(self, identity: bytes, request: Request, received: float, deferred: Deferred) -> None:
        self._send_from_worker(identity, self.reply(request, received, _attempt(deferred.finish)))


def _late(request: Request) -> bool:
    """Whether the client gave up on `request` before it could start (the server then does not start it)."""
    return request.deadline is not None and time.time() > request.deadline


def _attempt(run: Callable[[], Any]) -> Any:
    """``run()``'s result, or the exception it raised (a bug must cost one request, never a thread)."""
    try:
        return run()
    except Exception as exc:
        return exc
