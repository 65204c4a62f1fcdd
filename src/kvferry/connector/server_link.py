"""A connector's session with a ``kvferry server`` that outlives the server: a circuit breaker around the client.

vLLM calls the connector on its scheduling path, so a server that is down or gone must cost nothing per request:

- While the link is down every call fails at once with `ServerDown` (the connector turns that into a miss or a
  skipped store). Going down logs one WARNING; coming back logs one INFO line. No traceback, no per-call wait.
- A background thread reconnects with exponential backoff (0.25 s doubling to 30 s). On success it registers the
  engine's KV cache again (a restarted server has forgotten it) and bumps `generation`, so lock ids taken from an
  earlier server are never sent to a later one.
- What trips it: a connection error or timeout, the server's SHUTTING_DOWN, UNKNOWN_REGISTRATION (the server
  restarted) or SESSION_ENDED (the server ended our session, e.g. after a stall): our registration must be made
  again. Other server errors fail only that call.

It works with a client whose constructor waits for a handshake (it then runs in the background thread, bounded by
``timeout_s``) as well as with one that fails fast while the server is unreachable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvferry.client import KvferryClient, ServerError
from kvferry.futures import failed_future
from kvferry.security import ClientCurve

log = logging.getLogger(__name__)

T = TypeVar("T")
_OUTAGE_CODES = frozenset({"UNKNOWN_REGISTRATION", "SESSION_ENDED", "SHUTTING_DOWN"})
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.25, 30.0
_CLOSE_TIMEOUT_S = 2.0  # ending the session and stopping the client's thread, at an engine's shutdown


class ServerDown(ConnectionError):
    """The link to the kvferry server is down; the call was not sent."""


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the server is unreachable or lost our session (as opposed to refusing one call)."""
    if isinstance(exc, ServerError):
        return exc.code in _OUTAGE_CODES
    return isinstance(exc, ConnectionError | TimeoutError | FutureTimeout)


class ServerLink:
    """One session with the server at ``url``; ``register(client) -> registration id`` (the worker's KV) is
    called on every (re)connection when given. Thread-safe."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        register: Callable[[KvferryClient], int] | None = None,
        curve: ClientCurve | None = None,
        make_client: Callable[[str, float], KvferryClient] | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.chunk_size: int | None = None  # the server's, once it answered
        self.generation = 0  # bumped on every (re)connection
        self.incompatible: str | None = None  # why the link gave up for good
        self._register = register
        self._make_client = make_client or (lambda url, t: KvferryClient(url, timeout_s=t, curve=curve))
        self._lock = threading.Lock()
        self._client: KvferryClient | None = None
        self._registration: int | None = None
        self._up = False
        self._closed = False
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._check_chunk_size: Callable[[int], None] | None = None

    # -- connecting ------------------------------------------------------------------------------------------

    def connect(self, *, check_chunk_size: Callable[[int], None] | None = None) -> bool:
        """One attempt now (bounded by ``timeout_s``); on failure, one WARNING and background retries. A chunk
        size that ``check_chunk_size`` refuses, or a registration the server refuses as a bad argument, raises a
        ValueError here (a setting to fix, not an outage)."""
        self._check_chunk_size = check_chunk_size
        try:
            self._attempt(at_start=True)
        except (ConnectionError, TimeoutError, ServerError) as exc:
            self._went_down(self.generation, exc)
            return False
        return True

    @property
    def up(self) -> bool:
        return self._up

    def _attempt(self, *, at_start: bool = False) -> None:
        with self._lock:
            client = self._client
        if client is None:
            client = self._make_client(self.url, self.timeout_s)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._client = client
            if closed:
                client.close()
                raise ServerDown("the link was closed")
        chunk_size = client.get_chunk_size()
        if self.chunk_size is not None and chunk_size != self.chunk_size:
            self.incompatible = (
                f"the kvferry server at {self.url} now uses chunk size {chunk_size}, but this engine's connector "
                f"started with {self.chunk_size}; kvferry stays off for this engine until it restarts"
            )
            raise ServerDown(self.incompatible)
        if self.chunk_size is None:
            try:
                if self._check_chunk_size is not None:
                    self._check_chunk_size(chunk_size)
            except ValueError as exc:
                if at_start:
                    raise
                self.incompatible = str(exc)
                raise ServerDown(self.incompatible) from None
            self.chunk_size = chunk_size
        registration = None
        if self._register is not None:
            if self._registration is not None:
                with contextlib.suppress(ServerError):  # a server that never went away still holds the old one
                    client.unregister_kv_cache(self._registration)
            try:
                registration = self._register(client)
            except ServerError as exc:
                if exc.code != "BAD_ARGUMENT":
                    raise
                # The server refuses this engine's KV (a codec its dtype cannot take, a format it does not fit):
                # a setting to fix, not an outage, so it is never retried.
                self.incompatible = f"the kvferry server at {self.url} refused this engine's KV cache: {exc.message}"
                if at_start:
                    raise ValueError(self.incompatible) from None
                raise ServerDown(self.incompatible) from None
        # Said before the link is up: whoever sees it up finds the line logged (a test reads the log then).
        log.info("kvferry: connected to the kvferry server at %s (chunk size %d)", self.url, chunk_size)
        with self._lock:
            self._registration = registration
            self.generation += 1
            self._up = True

    def _went_down(self, generation: int, exc: BaseException) -> None:
        with self._lock:
            if self._closed or generation != self.generation or (not self._up and self._thread is not None):
                return
            self._up = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._reconnect, name="kvferry-reconnect", daemon=True)
                self._thread.start()
            self._wake.notify_all()
        log.warning(
            "kvferry: the kvferry server at %s is unavailable (%s: %s); lookups miss and stores are skipped until "
            "it is back (reconnecting in the background)",
            self.url,
            type(exc).__name__,
            exc,
        )

    def _reconnect(self) -> None:
        delay = _BACKOFF_FIRST_S
        while True:
            with self._lock:
                while self._up and not self._closed:
                    self._wake.wait()
                    delay = _BACKOFF_FIRST_S
                if self._closed:
                    return
                self._wake.wait(delay)
                if self._closed:
                    return
            try:
                self._attempt()
            except (ConnectionError, TimeoutError, ServerError) as exc:
                if self.incompatible is not None:
                    log.error("kvferry: %s", self.incompatible)
                    return
                log.debug("kvferry: reconnecting to %s failed: %s", self.url, exc)
                delay = min(delay * 2, _BACKOFF_MAX_S)

    # -- calls -----------------------------------------------------------------------------------------------

    def call(self, fn: Callable[[KvferryClient, int | None], T]) -> T:
        """``fn(client, registration)`` now; ServerDown at once while the link is down. An outage it raises
        takes the link down."""
        client, registration, generation = self._use()
        try:
            return fn(client, registration)
        except Exception as exc:
            if is_outage(exc):
                self._went_down(generation, exc)
            raise

    def wait(self, fn: Callable[[KvferryClient, int | None], Future[T]], timeout_s: float | None) -> T:
        """Submit ``fn``'s request and wait at most ``timeout_s`` for its reply (a timeout takes the link down)."""
        return self.call(lambda client, reg: fn(client, reg).result(timeout=timeout_s))

    def submit(self, fn: Callable[[KvferryClient, int | None], Future[T]]) -> Future[T]:
        """``fn``'s future; a future that fails with an outage takes the link down. Never raises: a link that is
        down gives a failed future."""
        try:
            client, registration, generation = self._use()
            future = fn(client, registration)
        except Exception as exc:
            if is_outage(exc) and not isinstance(exc, ServerDown):
                self._went_down(self.generation, exc)
            return failed_future(exc)

        def check(done: Future[Any]) -> None:
            exc = done.exception()
            if exc is not None and is_outage(exc):
                self._went_down(generation, exc)

        future.add_done_callback(check)
        return future

    def _use(self) -> tuple[KvferryClient, int | None, int]:
        with self._lock:
            if not self._up or self._client is None:
                raise ServerDown(self.incompatible or f"the kvferry server at {self.url} is unavailable")
            return self._client, self._registration, self.generation

    def close(self) -> None:
        """Stop reconnecting and end the session (the server frees the registration and its locks)."""
        with self._lock:
            self._closed = True
            self._up = False
            client, self._client = self._client, None
            self._wake.notify_all()
        if client is not None:
            # Bounded whether or not the server answers (an engine's Ctrl-C must not wait on it): the server
            # drops a session whose connection closes anyway.
            client.close(timeout_s=_CLOSE_TIMEOUT_S)
