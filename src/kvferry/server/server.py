"""The server: a ZMQ ROUTER socket and, with --ipc, a Unix socket (`kvferry.server.unix_clients`); a worker pool for
transfers, session tracking, the HTTP side port. How each request runs: `kvferry.server.runner`.

Threading: both sockets belong to one loop thread (ZMQ sockets are not thread-safe). Quick requests run on that
thread; transfers and registrations run on a worker pool, and the part of a LOOKUP or PREFETCH that waits for a
storage tier on a pool of its own (a frozen tier then holds up only the requests that need it); both hand their
reply frames back to the loop through an inproc PUSH/PULL pair. The loop also watches the ROUTER's monitor for
dropped connections (the ZMQ monitor reports the file descriptor, and each request frame carries the descriptor
it came on; a Unix socket client's session ends with its connection) and sweeps sessions whose heartbeats
stopped. A request is not started after its deadline, nor for a session the server has ended.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
from prometheus_client import generate_latest
from zmq.utils.monitor import parse_monitor_message

from kvferry.config import SecurityConfig, ServerConfig
from kvferry.protocol.fd_passing import fd_socket_path
from kvferry.protocol.messages import PROTOCOL_VERSION, ErrorCode
from kvferry.server.admission import Admission
from kvferry.server.auth import RequestAuth, check_exposure
from kvferry.server.cache_service import CacheService
from kvferry.server.event_stream import EventStream
from kvferry.server.fd_inbox import FdInbox
from kvferry.server.handlers import RequestHandlers
from kvferry.server.health import TierWatch, tier_health
from kvferry.server.http import HttpSidePort
from kvferry.server.metrics import ServerMetrics
from kvferry.server.ports import ServerStartError, bind_clients, remove_ipc_socket
from kvferry.server.runner import RequestRunner
from kvferry.server.sessions import SessionTable
from kvferry.server.unix_clients import UnixClients
from kvferry.stopping import join_thread, shut_down_pool, still_running, term_context

log = logging.getLogger("kvferry.server")

STOP_TIMEOUT_S = 5.0  # a stop's wait for running transfers and tier lookups, and for every thread and socket
_BATCH = 256  # requests taken off the socket per loop turn before looking at replies and the monitor
_instances = itertools.count()


class KvferryServer:
    """Serve `engine` to clients; `start()` binds and returns, `stop()` releases every session and port."""

    def __init__(
        self,
        config: ServerConfig,
        engine: CacheService,
        *,
        security: SecurityConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.security = security if security is not None else SecurityConfig()
        self.engine = engine
        self.metrics = ServerMetrics()
        # One registry for everything /metrics exports: the server's, the cache's and its tiers' families.
        self.metrics.registry.register(engine.metrics_registry)
        self._clock = clock
        self._started_at = clock()
        self._sessions = SessionTable(clock)
        self._handlers = RequestHandlers(
            engine,
            self._sessions,
            hello={
                "version": PROTOCOL_VERSION,
                "chunk_size": engine.chunk_size,
                "heartbeat_interval_s": config.heartbeat_interval_s,
                "heartbeat_timeout_s": config.heartbeat_timeout_s,
                "max_message_bytes": config.max_message_bytes,
            },
            end_session=self._end_session,
            server_stats=self._server_stats,
        )
        self._workers = ThreadPoolExecutor(config.transfer_workers, thread_name_prefix="kvferry-worker")
        self._tier_workers = ThreadPoolExecutor(config.tier_workers, thread_name_prefix="kvferry-tier")
        self._tier_watch: TierWatch | None = None
        self._events: EventStream | None = None  # KV events, when config.events_port is set
        self.events_port: int | None = None
        self.events_replay_port: int | None = None
        self._ctx = zmq.Context()
        self._reply_addr = f"inproc://kvferry-replies-{next(_instances)}"
        self._reply_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stop_deadline = 0.0  # set by stop(), before _stopping
        self._loop_thread: threading.Thread | None = None
        self._admission = Admission(config, self._sessions, self.metrics, clock, self._stopping)
        self._runner = RequestRunner(
            self._handlers, self.metrics, clock, self._workers, self._tier_workers, self._send_from_worker
        )
        # A transfer started on the socket thread whose rest goes to a worker after its answer is sent (loop only).
        self._to_finish: Callable[[], None] | None = None
        self._http: HttpSidePort | None = None
        self._auth: RequestAuth | None = None  # CURVE on the request socket (security.curve_secret_key_file)
        self.port: int = config.port
        self.ipc_endpoint: str | None = None  # ipc://PATH when config.ipc_path is set
        self._unix: UnixClients | None = None  # its clients (loop only)
        self.http_port: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind both ports and start serving; ServerStartError (naming the port) if either cannot be bound, or
        (naming the setting) if a port beyond loopback would take requests without credentials."""
        check_exposure(self.config, self.security)
        try:
            http_token = self.security.http_token_value()
        except ValueError as exc:
            raise ServerStartError(str(exc)) from None
        host = self.config.host
        with contextlib.ExitStack() as undo:  # what is open so far, closed again when a later listener fails
            if self.security.curve:
                self._auth = self._admission.auth = RequestAuth(self._ctx, self.security)
                undo.callback(self._close_auth)
            router = self._ctx.socket(zmq.ROUTER)
            undo.callback(router.close, linger=0)
            router.setsockopt(zmq.LINGER, 0)
            # Frames up to twice the limit are read and answered TOO_LARGE; beyond that ZMQ drops the connection
            # rather than buffer an unbounded frame.
            router.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
            if self._auth is not None:
                self._auth.secure(router)
            self.port, unix_listener = bind_clients(router, self.config, self.security)
            if unix_listener is not None:
                undo.callback(unix_listener.close)
                self.ipc_endpoint = f"ipc://{self.config.ipc_path}"
                self._handlers.fd_inbox = self._open_fd_inbox(fd_socket_path(self.ipc_endpoint.removeprefix("ipc://")))
                undo.callback(self._handlers.fd_inbox.close)
            if self.config.http_port is not None:
                try:
                    self._http = HttpSidePort(
                        host,
                        self.config.http_port,
                        health=self.health,
                        metrics=self.prometheus_text,
                        stats=self.stats,
                        token=http_token,
                    )
                except OSError as exc:
                    reason = exc.strerror or str(exc)
                    raise ServerStartError(f"cannot serve HTTP on {host}:{self.config.http_port}: {reason}") from exc
                undo.callback(lambda http: http.close(time.monotonic() + STOP_TIMEOUT_S), self._http)
                self.http_port = self._http.port
            if self.config.events_port is not None:
                secure = self._auth.secure if self._auth is not None else None
                try:
                    self._events = EventStream(self.engine, self.config, self._ctx, secure=secure)
                except zmq.ZMQError as exc:
                    raise ServerStartError(f"cannot publish KV events on {host}: {exc}") from exc
                self.events_port, self.events_replay_port = self._events.port, self._events.replay_port
            undo.pop_all()
        monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        replies_in = self._ctx.socket(zmq.PULL)
        replies_in.bind(self._reply_addr)
        self._replies_out = self._ctx.socket(zmq.PUSH)
        self._replies_out.connect(self._reply_addr)
        if self.engine.tiers:
            self._tier_watch = TierWatch(lambda: self.engine.tiers, self.config.tier_check_interval_s)
        self._loop_thread = threading.Thread(
            target=self._loop, args=(router, monitor, replies_in, unix_listener), name="kvferry-server", daemon=True
        )
        self._loop_thread.start()

    @staticmethod
    def _open_fd_inbox(path: str) -> FdInbox:
        """The descriptor socket beside the Unix socket: engines pass driver-mapped KV memory there."""
        try:
            return FdInbox(path)
        except OSError as exc:
            raise ServerStartError(f"cannot listen for passed descriptors on {path}: {exc}") from exc

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Finish running transfers, end every session (freeing its locks and mappings), close the ports; all
        within `timeout_s`. False if a thread the process's exit would wait for was still busy at that deadline (a
        transfer or a tier lookup that does not end), or the loop with it: left behind, with the sockets it holds."""
        if self._stopping.is_set():
            return True
        deadline = time.monotonic() + timeout_s
        self._stop_deadline = deadline
        self._stopping.set()
        loop_ended = self._loop_thread is None or join_thread(self._loop_thread, deadline)
        workers_ended = shut_down_pool(self._workers, deadline) & shut_down_pool(self._tier_workers, deadline)
        for session_id in self._sessions.ids():
            self._end_session(session_id, "shutdown")
        watch_ended = self._tier_watch is None or self._tier_watch.close(deadline)
        events_ended = self._events is None or self._events.stop(deadline)
        if self._http is not None:
            self._http.close(deadline)
        if self._loop_thread is not None:
            with self._reply_lock:  # a worker past the deadline may still send: it then finds the socket closed
                self._replies_out.close(linger=0)
        if loop_ended:  # the authenticator's socket on the context, closed before term waits for every socket
            self._close_auth()
        # With the loop stuck its sockets stay open, and term would wait for them: it is not waited for then.
        term_ended = term_context(self._ctx, deadline if loop_ended else time.monotonic())
        if self.ipc_endpoint is not None and self.config.ipc_path is not None:
            remove_ipc_socket(self.config.ipc_path)
        if self._handlers.fd_inbox is not None:
            self._handlers.fd_inbox.close(max(deadline - time.monotonic(), 0.0))
        if not (loop_ended and workers_ended and watch_ended and events_ended and term_ended):
            log.warning("the server stopped with threads still busy after %.1f s: %s", timeout_s, still_running())
        return loop_ended and workers_ended  # the tier watch is a daemon: a probe stuck in it holds up no exit

    # -- views ----------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """ "ok"; "degraded" while a storage tier is down (named in `unhealthy_tiers`: its lookups miss and its
        writes are dropped); "stopping"; or "down" when the socket loop has died. No I/O: tiers as last probed."""
        tiers = tier_health(self.engine.tiers)
        unhealthy = [t["name"] for t in tiers if not t["healthy"]]
        if self._stopping.is_set():
            status = "stopping"
        elif self._loop_thread is None or not self._loop_thread.is_alive():
            status = "down"
        else:
            status = "degraded" if unhealthy else "ok"
        return {"status": status, "sessions": len(self._sessions), "tiers": tiers, "unhealthy_tiers": unhealthy}

    def stats(self) -> dict[str, Any]:
        """The server's sessions, and the cache's counters, pool and tiers (what /stats serves)."""
        return {**self._server_stats(), "cache": self.engine.stats()}

    def _server_stats(self) -> dict[str, Any]:
        return {
            "uptime_s": round(self._clock() - self._started_at, 3),
            "port": self.port,
            "sessions": self._sessions.snapshot(),
            "open_registrations": self._sessions.open_registrations,
            "requests": self.metrics.requests.by_op(),
            **({"events": self._events.stats()} if self._events is not None else {}),
        }

    def prometheus_text(self) -> bytes:
        self.metrics.sessions.set(len(self._sessions))
        self.metrics.registrations.set(self._sessions.open_registrations)
        return generate_latest(self.metrics.registry)

    # -- the socket loop ------------------------------------------------------------------------------------

    def _close_auth(self) -> None:
        if self._auth is not None:
            self._auth.close()
            self._auth = self._admission.auth = None

    def _loop(
        self, router: zmq.Socket, monitor: zmq.Socket, replies_in: zmq.Socket, unix_listener: socket.socket | None
    ) -> None:
        poller = zmq.Poller()
        for sock in (router, monitor, replies_in):
            poller.register(sock, zmq.POLLIN)
        if unix_listener is not None:
            self._unix = UnixClients(unix_listener, poller, self.config.max_message_bytes)
        sweep_every = min(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s / 4)
        last_turn = self._clock()
        next_sweep = last_turn + sweep_every
        busy_poll_s = self.config.busy_poll_us / 1e6
        spin_until = 0.0
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(timeout=0 if last_turn < spin_until else 100))
                now = self._clock()
                if ready and busy_poll_s:
                    spin_until = now + busy_poll_s
                next_sweep = self._after_stall(last_turn, now, next_sweep)
                last_turn = now
                if monitor in ready:
                    self._drain_monitor(monitor)
                if replies_in in ready:
                    self._forward_replies(replies_in, router)
                drained = router not in ready or self._serve_requests(router, monitor)
                if self._unix is not None and ready:
                    self._unix.serve(ready, self._serve_unix, self._unix_ended)
                # Sweep only with no request waiting: after a stall, queued heartbeats count first. A stall
                # may also fall inside this turn, after its first look at the clock: looked at again here.
                end = self._clock()
                next_sweep = self._after_stall(now, end, next_sweep)
                if drained and end >= next_sweep:
                    next_sweep = end + sweep_every
                    self._sweep(end)
            # Let transfers and tier lookups already running answer before the socket closes (until the stop's
            # deadline: what is still running then is not answered).
            shut_down_pool(self._workers, self._stop_deadline)
            shut_down_pool(self._tier_workers, self._stop_deadline)
            self._forward_replies(replies_in, router)
        except zmq.ContextTerminated:
            pass  # left behind by a stop that gave up on it: the context is gone, and nobody is left to answer
        finally:
            if self._unix is not None:
                self._unix.close()
            router.disable_monitor()
            for sock in (monitor, replies_in, router):
                sock.close(linger=0)

    def _serve_requests(self, router: zmq.Socket, monitor: zmq.Socket) -> bool:
        """Serve up to a batch of waiting requests; True if none is left waiting."""
        for _ in range(_BATCH):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            identity = frames[0].bytes
            if len(frames) != 2:
                reply: bytes | None = self._admission.refuse(
                    None, ErrorCode.MALFORMED, f"a request is one frame, got {len(frames) - 1}"
                )
            else:
                user = str(frames[1].get("User-Id")) if self._auth is not None else None  # the ZAP handler's
                reply = self._serve_one(identity, frames[1].buffer, frames[1], monitor, user)
            if reply is not None:
                router.send_multipart([identity, reply])
            self._hand_over()
        return False

    def _serve_unix(self, identity: bytes, payload: memoryview) -> None:
        """One request from a client of the Unix socket (see kvferry.server.unix_clients)."""
        assert self._unix is not None
        reply = self._serve_one(identity, payload, None, None)
        if reply is not None:  # a transfer's answer leaves now, before its rest goes to a worker
            self._unix.send(identity, reply, hold=self._to_finish is None)
        self._hand_over()

    def _unix_ended(self, identity: bytes) -> None:
        self._end_session(identity, "disconnect")

    def _hand_over(self) -> None:
        """After a request's answer is sent: the rest of a transfer started on this thread goes to a worker."""
        if self._to_finish is not None:
            self._workers.submit(self._to_finish)
            self._to_finish = None

    def _serve_one(
        self,
        identity: bytes,
        payload: memoryview | bytes,
        source: zmq.Frame | None,
        monitor: zmq.Socket | None,
        user: str | None = None,
    ) -> bytes | None:
        try:
            return self._accept(identity, payload, source, monitor, user)
        except Exception as exc:  # a bug must cost one request, never the socket loop
            log.exception("request from %s could not be handled", identity.hex())
            return self._admission.refuse(None, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _accept(
        self,
        identity: bytes,
        payload: memoryview | bytes,
        source: zmq.Frame | None,
        monitor: zmq.Socket | None,
        user: str | None,
    ) -> bytes | None:
        """Take up one request; returns the reply now, or None when a worker will send it."""
        drain = (lambda: self._drain_monitor(monitor)) if monitor is not None else (lambda: None)
        admitted = self._admission.admit(identity, payload, source, user, drain)
        if isinstance(admitted, bytes):
            return admitted
        reply, self._to_finish = self._runner.dispatch(identity, admitted.session, admitted.request, admitted.received)
        return reply

    def _send_from_worker(self, identity: bytes, reply: bytes) -> None:
        with self._reply_lock:
            if not self._replies_out.closed:  # closed: the server stopped without waiting for this worker
                self._replies_out.send_multipart([identity, reply])

    def _forward_replies(self, replies_in: zmq.Socket, router: zmq.Socket) -> None:
        while True:
            try:
                frames = replies_in.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if self._unix is not None and identity in self._unix:
                self._unix.send(identity, frames[1].bytes)
            else:
                router.send_multipart(frames)  # to a departed client ROUTER drops it silently

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for session_id in self._sessions.on_connection(event["value"]):
                    self._end_session(session_id, "disconnect")

    def _after_stall(self, before: float, now: float, next_sweep: float) -> float:
        """The next sweep's time, put off when this process was stalled (stopped, swapped) between `before` and
        `now`: its clients' silence is its own, so each gets a whole timeout to be heard again before it is judged."""
        if now - before > self.config.heartbeat_timeout_s / 2:
            return max(next_sweep, now + self.config.heartbeat_timeout_s)
        return next_sweep

    def _sweep(self, now: float) -> None:
        """End the sessions silent for a heartbeat timeout before `now` (read before a stall could fall in here)."""
        deadline = now - self.config.heartbeat_timeout_s
        for session_id in self._sessions.silent_since(deadline):
            self._end_session(session_id, "heartbeat")
        self._handlers.reserved.free_due(now)

    def _end_session(self, session_id: bytes, reason: str) -> dict[str, Any]:
        released = self._sessions.end(session_id, reason)
        if released is None:
            return {"locks": 0, "registrations": 0}
        for lock_id in released.locks:
            self.engine.free_lookup_locks(lock_id)
        # its reserved objects: its process may still be copying into them, and would stop within a heartbeat timeout
        self._handlers.reserved.retire(released.reserved, self._clock() + self.config.heartbeat_timeout_s)
        self.metrics.sessions_ended.labels(reason).inc()
        log.info(
            "session %s ended (%s): freed %d locks, %d registrations (%d after their transfers)",
            session_id.hex(),
            reason,
            len(released.locks),
            released.registrations,
            released.deferred,
        )
        return {"locks": len(released.locks), "registrations": released.registrations}
