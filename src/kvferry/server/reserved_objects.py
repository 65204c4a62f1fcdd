"""RESERVE and COMMIT: stores an engine copies itself into the server's shared pool (`cache.shared_pool`).

RESERVE hands a session objects of a whole chunk in its registration's object shape (pool offsets, with the pool's
memfd as LOCATE names it); the engine keeps them in stock, copies a store's chunks (and tail) into them with its own
transfer, in its own GPU context, and once its copy is over sends COMMIT, which indexes them as a STORE's objects
(`kvferry.cache.written`) and reserves as many again. A COMMIT names only objects reserved for its session; those
of a session that ends are freed after ``hold_s`` (its process may still be copying into them), not at once.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kvferry.protocol.messages import ErrorCode, ProtocolError, unpack_ids
from kvferry.server.cache_service import CacheService
from kvferry.server.requests import CommitArgs, ReserveArgs
from kvferry.server.sessions import Registration, Session, SessionTable

log = logging.getLogger(__name__)


class ReservedObjects:
    """The RESERVE and COMMIT handlers, and the objects of ended sessions waiting to be freed. Thread-safe."""

    def __init__(self, engine: CacheService, sessions: SessionTable) -> None:
        self._engine = engine
        self._sessions = sessions
        self._lock = threading.Lock()
        self._retired: list[tuple[float, list[int]]] = []  # (free at, time.monotonic; offsets)

    def reserve(self, session: Session, args: ReserveArgs) -> dict[str, Any]:
        reg, pool = self._registration(session, args.registration)
        return {"objects": self._reserve(session, reg, args.count), "pool": pool}

    def commit(self, session: Session, args: CommitArgs) -> dict[str, Any]:
        reg, _ = self._registration(session, args.registration)
        tokens = unpack_ids(args.tokens, "tokens")
        tail = None if args.tail is None else (args.tail[0], args.tail[1])
        offsets = [*args.objects, *([tail[0]] if tail is not None else [])]
        self._sessions.take_reserved(session, offsets)
        try:
            written = self._engine.written
            stored = written.adopt(tokens, reg.namespace, reg.geometry, args.first_chunk, args.objects, tail)
        except ValueError as exc:  # nothing adopted: the objects are still the session's
            if not self._sessions.add_reserved(session, offsets):
                self._engine.written.give_back(offsets)
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"COMMIT: {exc}") from None
        return {"stored": stored, "objects": self._reserve(session, reg, args.refill) if args.refill else []}

    def retire(self, offsets: list[int], free_at: float) -> None:
        """An ended session's reserved objects, freed by `free_due` from ``free_at`` (time.monotonic) on."""
        if offsets:
            with self._lock:
                self._retired.append((free_at, offsets))

    def free_due(self, now: float) -> int:
        """Free the retired objects due by ``now``; returns how many."""
        with self._lock:
            due = [offsets for free_at, offsets in self._retired if free_at <= now]
            self._retired = [(free_at, offsets) for free_at, offsets in self._retired if free_at > now]
        freed = 0
        for offsets in due:
            self._engine.written.give_back(offsets)
            freed += len(offsets)
        if freed:
            log.info("freed %d objects reserved by ended sessions", freed)
        return freed

    def _registration(self, session: Session, registration: int) -> tuple[Registration, dict[str, int]]:
        """The session's registration, where its stores may be copied by the engine: not a tenant's (the pool holds
        every tenant's objects), a shared pool, plain objects of every head. And the pool's memfd as named."""
        if session.grants is not None:
            raise ProtocolError(ErrorCode.FORBIDDEN, f"a tenant ({session.grants.name}) stores through STORE")
        shared = self._engine.shared_pool
        if shared is None:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "this server's pool is not shared (cache.shared_pool)")
        reg = self._sessions.use_registration(session, registration)
        self._sessions.done_with(reg)
        if reg.namespace.codec != "none":
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{reg.namespace.codec} objects are stored through STORE")
        if reg.geometry.partial_heads:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "a slice of the heads is stored through STORE")
        fd, nbytes = shared
        return reg, {"pid": os.getpid(), "fd": fd, "bytes": nbytes}

    def _reserve(self, session: Session, reg: Registration, count: int) -> list[int]:
        try:
            offsets = self._engine.written.reserve(reg.geometry, count)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'count': {exc}") from None
        if not self._sessions.add_reserved(session, offsets):  # the session ended meanwhile
            self._engine.written.give_back(offsets)
            return []
        return offsets
