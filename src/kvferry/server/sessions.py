"""Per-client state: what each session holds, so all of it can be released when the client goes away.

A session is one client socket (its ZMQ routing id). It holds KV registrations (mapped memory), lookup
locks and prefetch handles. It ends on END_SESSION, when its TCP connection drops, or when it has been
silent for the heartbeat timeout. Ending frees its locks and closes its registrations; a registration that
a transfer is still using is closed by that transfer when it finishes, so memory is never unmapped under a
running copy.

A session the server ended (disconnect, heartbeat, shutdown) is remembered for a while, and frames still
arriving under its id are refused (SESSION_ENDED) rather than opening it again: a killed client's requests
queued behind its disconnect must not take locks nobody will free. A client that asked to end its session
(END_SESSION) may go on under the same id: that opens a new session.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvferry.protocol.messages import ErrorCode, ProtocolError
from kvferry.security import TenantGrants
from kvferry.server.kv_mapping import MappedKV
from kvferry.transfer import forget_plans


@dataclass(eq=False)
class Registration:
    """A client's KV as mapped by the server, plus what the cache needs to move it."""

    id: int
    kv: MappedKV
    format: Any  # EngineKVFormat
    block_size: int | None
    namespace: Any  # CacheNamespace
    geometry: Any  # KVGeometry, described once at registration
    ready: Any = None  # the client's CUDA IPC events its transfers wait on (kvferry.server.client_events.ClientEvents)
    done_flags: Any = None  # the client's done-flag words (kvferry.server.done_signal.DoneFlags)
    users: int = 0  # transfers running on this registration now
    closing: bool = False


@dataclass(eq=False)
class Session:
    id: bytes
    last_seen: float
    fd: int  # the connection the session's requests come on (ZMQ SRCFD)
    user: str | None = None  # the client key CURVE authenticated (Z85), None without CURVE
    grants: TenantGrants | None = None  # the namespaces its tenant may use; None: every one
    registrations: dict[int, Registration] = field(default_factory=dict)
    locks: set[int] = field(default_factory=set)
    # LOCATE's read leases: freed by the client, else at their deadline, never with the session (its process may
    # still be copying from the objects)
    leases: set[int] = field(default_factory=set)
    # RESERVE's objects (pool offsets) not yet committed: freed a lease's time after the session ends, not at once
    # (its process may still be copying into them)
    reserved: set[int] = field(default_factory=set)
    prefetches: dict[int, Future[Any]] = field(default_factory=dict)
    requests: int = 0


@dataclass(frozen=True)
class Released:
    """What ending a session let go of; the caller frees `locks` in the cache engine."""

    session: bytes
    reason: str
    locks: list[int]
    registrations: int
    deferred: int  # registrations still in use by a transfer; closed when it finishes
    reserved: list[int] = field(default_factory=list)  # its reserved objects, to free once no copy can reach them


# Ended session ids remembered (at most this many, for at most this long): a killed client's frames are all
# queued when its disconnect is seen, so minutes are plenty; a client frozen for longer than that and thawed
# opens a new session under its old id, which knows none of its registrations (UNKNOWN_REGISTRATION).
ENDED_KEPT = 65536
ENDED_KEPT_S = 600.0


class SessionTable:
    """All live sessions; thread-safe (the socket loop and transfer workers both use it)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[bytes, Session] = {}
        self._ended: OrderedDict[bytes, float] = OrderedDict()  # session id -> when the server ended it
        # Registration, lock and prefetch ids start at a random point: an id held by a client of an earlier
        # server process (before a restart) names nothing here, never another registration.
        self._ids = itertools.count(secrets.randbelow(1 << 40) + 1)
        self.open_registrations = 0  # registrations whose memory is still mapped, closing ones included
        # Transfers answered at enqueue whose bookkeeping (a store's objects becoming hits) is still to come:
        # (session, request id) -> (the copy's handle, what carries out its bookkeeping). See `settle`.
        self._answered_early: dict[tuple[bytes, int], tuple[Any, Callable[[float], None]]] = {}

    def touch(self, session_id: bytes) -> Session | None:
        """The live session of `session_id`, marked as seen now; None if there is none."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                session.last_seen = self._clock()
                session.requests += 1
            return session

    def open(self, session_id: bytes, fd: int, user: str | None = None, grants: TenantGrants | None = None) -> Session:
        """A new session for a client's first request, arrived on connection `fd` from authenticated client key
        `user` (None without CURVE), whose tenant may use the namespaces of `grants` (None: every one).

        A session keeps its connection: when that drops, the session ends (`on_connection`), so a client
        that reconnects starts a new one.
        """
        with self._lock:
            session = Session(session_id, self._clock(), fd, user, grants, requests=1)
            self._sessions[session_id] = session
            return session

    def was_ended(self, session_id: bytes) -> bool:
        """Whether the server ended session `session_id` recently (its frames are refused, see the module)."""
        with self._lock:
            return session_id in self._ended

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self) -> list[bytes]:
        with self._lock:
            return list(self._sessions)

    def next_id(self) -> int:
        return next(self._ids)

    def add_registration(self, session: Session, reg: Registration) -> bool:
        """Attach `reg`; False (and `reg` closed) if the session ended while it was being mapped."""
        with self._lock:
            attached = self._sessions.get(session.id) is session
            if attached:
                session.registrations[reg.id] = reg
                self.open_registrations += 1
        if not attached:
            self._release(reg)
        return attached

    def use_registration(self, session: Session, reg_id: int) -> Registration:
        """Borrow registration `reg_id` of `session` for one transfer; pair with `done_with`."""
        with self._lock:
            reg = session.registrations.get(reg_id)
            if reg is None or reg.closing:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_REGISTRATION,
                    f"'registration'={reg_id} is not registered by this session "
                    f"(it holds {sorted(session.registrations)})",
                )
            reg.users += 1
            return reg

    def done_with(self, reg: Registration) -> None:
        with self._lock:
            reg.users -= 1
            if reg.closing and reg.users == 0:
                self._close(reg)

    def unregister(self, session: Session, reg_id: int) -> None:
        with self._lock:
            reg = session.registrations.pop(reg_id, None)
            if reg is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_REGISTRATION,
                    f"'registration'={reg_id} is not registered by this session",
                )
            self._retire(reg)

    def answering_early(self, session: Session, request_id: int, handle: Any, settle: Callable[[float], None]) -> None:
        """Note that a transfer is answered before its bookkeeping, which `settle(timeout_s)` carries out (or waits
        for, when under way); call `answered` once it is done."""
        with self._lock:
            self._answered_early[session.id, request_id] = (handle, settle)

    def answered(self, session: Session, request_id: int) -> None:
        with self._lock:
            self._answered_early.pop((session.id, request_id), None)

    def settle(self, timeout_s: float = 1.0) -> None:
        """Before a request reads the cache: the bookkeeping of transfers answered early whose copy the GPU has
        finished, done now on this thread unless under way elsewhere (then waited for: it follows the copy by
        microseconds; `timeout_s` only bounds a stuck one). Their clients may have seen them done and told others
        (a tensor-parallel rank its peers, an engine its scheduler), who then expect their effects: a STORE's
        chunks found by the next LOOKUP of any session. Copies still running are left alone: nobody can have seen
        them done."""
        with self._lock:
            if not self._answered_early:
                return
            entries = list(self._answered_early.values())
        for handle, settle in entries:
            if handle.done():
                settle(timeout_s)

    def add_lock(self, session: Session, lock_id: int) -> None:
        with self._lock:
            session.locks.add(lock_id)

    def drop_lock(self, session: Session, lock_id: int) -> bool:
        """Forget lock `lock_id` of `session`; False if the session does not hold it."""
        return bool(self.drop_locks(session, [lock_id]))

    def add_reserved(self, session: Session, offsets: list[int]) -> bool:
        """Note objects reserved for `session`; False where it ended meanwhile (the caller frees them)."""
        with self._lock:
            if self._sessions.get(session.id) is not session:
                return False
            session.reserved.update(offsets)
            return True

    def take_reserved(self, session: Session, offsets: list[int]) -> None:
        """Hand `offsets`, reserved for `session`, to the caller (to commit); BAD_ARGUMENT, taking none, where one
        is not (another session's, committed already, or never reserved)."""
        with self._lock:
            foreign = [offset for offset in offsets if offset not in session.reserved]
            if foreign or len(set(offsets)) != len(offsets):
                raise ProtocolError(
                    ErrorCode.BAD_ARGUMENT,
                    f"'objects': {foreign or offsets} are not objects reserved for the sending session (each once)",
                )
            session.reserved.difference_update(offsets)

    def add_lease(self, session: Session, lease_id: int) -> None:
        with self._lock:
            session.leases.add(lease_id)

    def drop_locks(self, session: Session, lock_ids: list[int]) -> list[int]:
        """Forget those of `lock_ids` (lookup locks and read leases: one id space) that `session` holds; returns
        them."""
        with self._lock:
            held = [lock_id for lock_id in lock_ids if lock_id in session.locks or lock_id in session.leases]
            session.locks.difference_update(held)
            session.leases.difference_update(held)
            return held

    def add_prefetch(self, session: Session, future: Future[Any]) -> int:
        with self._lock:
            prefetch_id = next(self._ids)
            session.prefetches[prefetch_id] = future
            return prefetch_id

    def get_prefetch(self, session: Session, prefetch_id: int) -> Future[Any]:
        with self._lock:
            future = session.prefetches.get(prefetch_id)
        if future is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_PREFETCH,
                f"'prefetch'={prefetch_id} is not a pending prefetch of this session",
            )
        return future

    def drop_prefetch(self, session: Session, prefetch_id: int) -> None:
        with self._lock:
            session.prefetches.pop(prefetch_id, None)

    def end(self, session_id: bytes, reason: str) -> Released | None:
        """Remove the session (None if unknown); its registrations close now or after their transfers."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return None
            if reason != "end_session":
                self._remember_ended(session_id)
            deferred = sum(not self._retire(reg) for reg in session.registrations.values())
            held = len(session.registrations)
            released = Released(session_id, reason, sorted(session.locks), held, deferred, sorted(session.reserved))
            session.registrations.clear()
            session.reserved.clear()
            session.locks.clear()
            session.prefetches.clear()
        return released

    def silent_since(self, deadline: float) -> list[bytes]:
        """Sessions not heard from since `deadline`."""
        with self._lock:
            return [sid for sid, s in self._sessions.items() if s.last_seen < deadline]

    def on_connection(self, fd: int) -> list[bytes]:
        """Sessions whose last request came on connection `fd`."""
        with self._lock:
            return [sid for sid, s in self._sessions.items() if s.fd == fd]

    def snapshot(self) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return [
                {
                    "session": sid.hex(),
                    "idle_s": round(now - s.last_seen, 3),
                    "registrations": len(s.registrations),
                    "locks": len(s.locks),
                    "requests": s.requests,
                }
                for sid, s in self._sessions.items()
            ]

    def _remember_ended(self, session_id: bytes) -> None:
        now = self._clock()
        ended = self._ended
        ended[session_id] = now
        ended.move_to_end(session_id)
        while ended and (len(ended) > ENDED_KEPT or next(iter(ended.values())) < now - ENDED_KEPT_S):
            ended.popitem(last=False)

    def _retire(self, reg: Registration) -> bool:
        """Close `reg` now if no transfer uses it (True), else mark it for `done_with` to close (False)."""
        reg.closing = True
        if reg.users == 0:
            self._close(reg)
            return True
        return False

    def _close(self, reg: Registration) -> None:
        self._release(reg)
        self.open_registrations -= 1

    @staticmethod
    def _release(reg: Registration) -> None:
        if reg.done_flags is not None:
            reg.done_flags.close()
        reg.kv.close()
        if reg.geometry is not None:
            forget_plans(reg.geometry)  # a cached plan would keep the client's mapped memory open
        reg.geometry = None  # it holds the mapped tensors too
