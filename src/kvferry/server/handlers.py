"""What each request op does: validated arguments in, a result map out, the cache engine doing the work.

Handlers raise ProtocolError for requests they refuse; ValueError/TypeError from the cache engine (bad block
ids, a format that does not match the tensors) become BAD_ARGUMENT replies carrying the engine's message.
`INLINE_OPS` run on the socket thread (they are quick and touch no KV memory); the rest run on a worker. An
inline op that needs a storage tier's answer (a LOOKUP that misses in the pool, a PREFETCH) returns `Deferred`:
the server finishes it on its tier workers, so a slow or frozen tier never holds up the socket thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvferry.cache import CacheNamespace, Located, LookupResult
from kvferry.cache.keys import TokenIds
from kvferry.formats import EngineKVFormat, describe, with_codec
from kvferry.protocol.messages import ErrorCode, Op, ProtocolError, unpack_ids
from kvferry.server.cache_service import CacheService
from kvferry.server.client_events import open_client_events
from kvferry.server.done_signal import DoneFlags
from kvferry.server.fd_inbox import FdInbox
from kvferry.server.kv_mapping import map_kv, map_shared
from kvferry.server.requests import (
    DemoteArgs,
    FreeLocksArgs,
    LocateArgs,
    LookupArgs,
    LookupEachArgs,
    Namespace,
    NoArgs,
    PrefetchArgs,
    PrefetchStatusArgs,
    RegisterArgs,
    RegistrationArgs,
)
from kvferry.server.reserved_objects import ReservedObjects
from kvferry.server.sessions import Registration, Session, SessionTable
from kvferry.server.transfers import Transfers
from kvferry.transfer.api import prepare_gpu

log = logging.getLogger("kvferry.server")

_T = TypeVar("_T")
_PoolAnswer = tuple[LookupResult, Callable[[], LookupResult] | None]  # `CacheService.lookup_pool`'s

INLINE_OPS = frozenset(
    {
        Op.PING,
        Op.GET_CHUNK_SIZE,
        Op.LOOKUP,
        Op.LOOKUP_EACH,
        Op.LOCATE,  # the pool's index only: a tier is never asked
        Op.PREFETCH,
        Op.PREFETCH_STATUS,
        Op.FREE_LOOKUP_LOCKS,
        Op.DEMOTE,
        Op.END_SESSION,
        Op.STATS,
    }
)


@dataclass(frozen=True, slots=True)
class Deferred:
    """The rest of a request that waits for tier I/O: `finish()` gives its result map, on a tier worker."""

    finish: Callable[[], dict[str, Any]]


Handler = Callable[[Session, Any], "dict[str, Any] | Deferred"]


class RequestHandlers:
    """The op table of one server. `end_session` is shared with the socket loop's disconnect handling."""

    def __init__(
        self,
        engine: CacheService,
        sessions: SessionTable,
        *,
        hello: dict[str, Any],
        end_session: Callable[[bytes, str], dict[str, Any]],
        server_stats: Callable[[], dict[str, Any]],
    ) -> None:
        self._engine = engine
        self._sessions = sessions
        self._hello = hello
        self._end_session = end_session
        self._server_stats = server_stats
        # Key spaces named by clients that hold no KV (a scheduler asks for the same few on every LOOKUP): making
        # one hashes its description (~25 us a request on the CPU machine), so each is made once.
        self._key_spaces: dict[tuple[Any, ...], CacheNamespace] = {}
        self.transfers = Transfers(engine, sessions)
        self.reserved = ReservedObjects(engine, sessions)
        self.fd_inbox: FdInbox | None = None  # descriptors clients pass (with --ipc): set once the server listens
        self.table: dict[Op, Handler] = {
            Op.PING: self.ping,
            Op.GET_CHUNK_SIZE: self.get_chunk_size,
            Op.REGISTER_KV_CACHE: self.register,
            Op.UNREGISTER_KV_CACHE: self.unregister,
            Op.LOOKUP: self.lookup,
            Op.LOOKUP_EACH: self.lookup_each,
            Op.LOCATE: self.locate,
            Op.RESERVE: self.reserved.reserve,
            Op.COMMIT: self.reserved.commit,
            Op.PREFETCH: self.prefetch,
            Op.PREFETCH_STATUS: self.prefetch_status,
            Op.FREE_LOOKUP_LOCKS: self.free_lookup_locks,
            Op.DEMOTE: self.demote,
            Op.END_SESSION: self.end_session,
            Op.CLEAR: self.clear,
            Op.STATS: self.stats,
        }

    def run(self, op: Op, session: Session, args: Any, deadline: float | None) -> dict[str, Any] | Deferred:
        """Run op `op`; a STORE keeps only chunks copied by `deadline` (when its client stops waiting)."""
        if op is Op.STORE or op is Op.RETRIEVE:
            return self.transfers.run(session, args, store=op is Op.STORE, deadline=deadline)
        return self.table[op](session, args)

    def ping(self, session: Session, _: NoArgs) -> dict[str, Any]:
        return {**self._hello, "session": session.id.hex(), "time": time.time()}

    def get_chunk_size(self, _: Session, __: NoArgs) -> dict[str, Any]:
        return {"chunk_size": self._engine.chunk_size}

    def register(self, session: Session, args: RegisterArgs) -> dict[str, Any]:
        deployment = args.namespace
        if session.grants is not None and not session.grants.allows(deployment.model, deployment.salt):
            log.warning(
                "tenant %s may not register KV in model %r salt %r: refused",
                session.grants.name,
                deployment.model,
                deployment.salt,
            )
            raise ProtocolError(
                ErrorCode.BAD_ARGUMENT,
                f"'namespace': model {deployment.model!r} with salt {deployment.salt!r} is not one this client's "
                "tenant may use (security.tenants)",
            )
        try:
            fmt = EngineKVFormat(args.format)
        except ValueError:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'format'={args.format} is not an EngineKVFormat id") from None
        kv = map_kv(args, self.fd_inbox)
        done_flags = None
        try:
            ready = open_client_events(kv.device, args.ready_events or [])
            if args.done_flags is not None:
                done_flags = DoneFlags(map_shared(args.done_flags, "done_flags"), kv.device)
            # Described once here: every transfer of this registration reuses the checked geometry.
            geometry = describe(
                fmt, kv.paged, args.block_size, heads=(args.heads[0], args.heads[1]) if args.heads else None
            )
            namespace = self._engine.namespace_for(
                deployment.model,
                fmt,
                kv.paged,
                world_size=deployment.world_size,
                rank=deployment.rank,
                salt=deployment.salt,
                block_size=args.block_size,
                geometry=geometry,
                codec=deployment.codec,
                kv_cache_dtype=deployment.kv_cache_dtype,
                group=deployment.group,
                split=deployment.split,
            )
            if kv.device.type == "cuda":  # its kernels compiled now: no transfer of the registration pays for it
                prepare_gpu(with_codec(geometry, namespace.codec))
        except BaseException:
            if done_flags is not None:
                done_flags.close()
            kv.close()
            raise
        reg = Registration(self._sessions.next_id(), kv, fmt, args.block_size, namespace, geometry, ready, done_flags)
        if not self._sessions.add_registration(session, reg):
            raise ProtocolError(ErrorCode.UNKNOWN_REGISTRATION, "the session ended while registering")
        return {
            "registration": reg.id,
            "device": str(kv.device),
            "tensors": kv.num_tensors,
            "mapped_bytes": kv.mapped_bytes,
            "kv_dtype": namespace.kv_dtype,
            "layout": namespace.layout,
            "done_flags": done_flags.slots if done_flags is not None else 0,
        }

    def unregister(self, session: Session, args: RegistrationArgs) -> dict[str, Any]:
        self._sessions.settle()  # a transfer its client saw done no longer holds the registration open
        self._sessions.unregister(session, args.registration)
        return {}

    def lookup(self, session: Session, args: LookupArgs) -> dict[str, Any] | Deferred:
        namespace = self._namespace(session, args.registration, args.namespace)
        tokens = unpack_ids(args.tokens, "tokens")
        self._sessions.settle()
        locate = args.locate and not args.first_chunk and self._not_located(session, namespace) is None
        answer = self._lookup_pool(
            session, tokens, namespace, args.lock, args.block_size, args.first_chunk, locate=locate
        )
        found, below = answer
        if below is None:
            return self._lookup_result(found)
        return Deferred(lambda: self._or_release(session, [answer], lambda: self._lookup_result(below())))

    def lookup_each(self, session: Session, args: LookupEachArgs) -> dict[str, Any] | Deferred:
        """A LOOKUP of each prompt, answered together (``found``, in order): one request's work and round trip
        where an SGLang lookup sent one a page. Every prompt is checked before any is looked up (or locked)."""
        namespace = self._namespace(session, args.registration, args.namespace)
        prompts = [unpack_ids(tokens, f"prompts[{i}]") for i, tokens in enumerate(args.prompts)]
        self._sessions.settle()
        answers: list[_PoolAnswer] = []

        def look_up_each() -> None:
            for tokens in prompts:
                answers.append(self._lookup_pool(session, tokens, namespace, args.lock, args.block_size))

        self._or_release(session, answers, look_up_each)
        if all(below is None for _, below in answers):
            return {"found": [self._lookup_result(found) for found, _ in answers]}

        def with_the_tiers() -> dict[str, Any]:
            return {"found": [self._lookup_result(found if below is None else below()) for found, below in answers]}

        return Deferred(lambda: self._or_release(session, answers, with_the_tiers))

    def locate(self, session: Session, args: LocateArgs) -> dict[str, Any]:
        """A prefix's objects in the shared pool (`CacheEngine.locate`) and the pool's memfd as this process holds
        it, for an engine of this user on this host that maps ``/proc/<pid>/fd/<fd>`` and copies them itself
        before the lease's ``deadline`` (time.monotonic, the host's); FREE_LOOKUP_LOCKS ends the lease."""
        _not_for_tenants(session, "LOCATE hands out the pool, every tenant's objects")  # before its key space
        namespace = self._namespace(session, args.registration, args.namespace)
        refused = self._not_located(session, namespace)
        if refused is not None:
            raise refused
        tokens = unpack_ids(args.tokens, "tokens")
        self._sessions.settle()  # stores seen done are hits
        found = self._engine.locate(tokens, namespace=namespace, block_size=args.block_size)
        if found.lease is not None:
            self._sessions.add_lease(session, found.lease)
        return {"tokens": found.tokens, **self._located_reply(found)}

    def _not_located(self, session: Session, namespace: CacheNamespace) -> ProtocolError | None:
        """Why LOCATE refuses ``session`` the hits in ``namespace`` (a located LOOKUP then only locks), or None."""
        if session.grants is not None:
            return ProtocolError(ErrorCode.FORBIDDEN, f"the pool is not handed to a tenant ({session.grants.name})")
        if self._engine.shared_pool is None:
            return ProtocolError(ErrorCode.BAD_ARGUMENT, "this server's pool is not shared (cache.shared_pool)")
        if namespace.codec != "none":
            return ProtocolError(ErrorCode.BAD_ARGUMENT, f"{namespace.codec} objects are read through RETRIEVE")
        why = self._engine.not_locatable
        return None if why is None else ProtocolError(ErrorCode.BAD_ARGUMENT, why)

    def _located_reply(self, found: Located) -> dict[str, Any]:
        shared = self._engine.shared_pool
        assert shared is not None  # located only out of a shared pool
        fd, nbytes = shared
        return {
            "lease": found.lease,
            "deadline": found.deadline,
            "objects": found.objects,
            "pool": {"pid": os.getpid(), "fd": fd, "bytes": nbytes},
        }

    def _lookup_result(self, found: LookupResult) -> dict[str, Any]:
        result: dict[str, Any] = {"tokens": found.hit_tokens, "pending": found.pending_tokens, "lock": found.lock_id}
        if found.located is not None:
            result["located"] = self._located_reply(found.located)
        return result

    def _lookup_pool(
        self,
        session: Session,
        tokens: TokenIds,
        namespace: CacheNamespace,
        lock: bool,
        block_size: int | None,
        first_chunk: int = 0,
        *,
        locate: bool = False,
    ) -> _PoolAnswer:
        found, below = self._engine.lookup_pool(
            tokens, namespace=namespace, lock=lock, block_size=block_size, first_chunk=first_chunk, locate=locate
        )
        if found.located is not None and found.located.lease is not None:  # kept past the session's end, as
            self._sessions.add_lease(session, found.located.lease)  # LOCATE's lease is (`Session.leases`)
        elif found.lock_id is not None:
            self._sessions.add_lock(session, found.lock_id)
        return found, below

    def _or_release(self, session: Session, answers: list[_PoolAnswer], work: Callable[[], _T]) -> _T:
        """``work``, or -- when it raises -- the locks ``answers`` took freed: the request fails, so its client
        never learns their ids and they would stay held until the lock's timeout or the session's end."""
        try:
            return work()
        except BaseException:
            locks = [found.lock_id for found, _ in answers if found.lock_id is not None]
            self._engine.free_lookup_locks_many(self._sessions.drop_locks(session, locks))
            raise

    def prefetch(self, session: Session, args: PrefetchArgs) -> dict[str, Any] | Deferred:
        namespace = self._namespace(session, args.registration, args.namespace)
        tokens = unpack_ids(args.tokens, "tokens")
        self._sessions.settle()  # its answer counts the pool's hits, as a LOOKUP's does

        def start() -> dict[str, Any]:
            future = self._engine.prefetch(tokens, namespace=namespace)  # asks the tiers which chunks they hold
            return {"prefetch": self._sessions.add_prefetch(session, future)}

        return Deferred(start) if self._engine.tiers else start()

    def prefetch_status(self, session: Session, args: PrefetchStatusArgs) -> dict[str, Any]:
        future = self._sessions.get_prefetch(session, args.prefetch)
        if not future.done():
            return {"done": False, "tokens": 0}
        self._sessions.drop_prefetch(session, args.prefetch)
        error = future.exception()
        return {"done": True, "tokens": 0 if error else int(future.result()), "error": _describe(error)}

    def free_lookup_locks(self, session: Session, args: FreeLocksArgs) -> dict[str, Any]:
        """One lock: ``freed`` says whether it was still held (a lock the session never held is refused). Several:
        ``freed`` counts those still held; a lock of another session, or one already ended, is left alone."""
        if args.locks is not None and args.lock is None:
            return {"freed": self._engine.free_lookup_locks_many(self._sessions.drop_locks(session, args.locks))}
        if args.lock is None or args.locks is not None:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "give one of 'lock' and 'locks'")
        if not self._sessions.drop_lock(session, args.lock):
            raise ProtocolError(ErrorCode.UNKNOWN_LOCK, f"'lock'={args.lock} is not held by this session")
        return {"freed": bool(self._engine.free_lookup_locks(args.lock))}

    def demote(self, session: Session, args: DemoteArgs) -> dict[str, Any]:
        namespace = self._namespace(session, args.registration, args.namespace)
        tokens = unpack_ids(args.tokens, "tokens")
        # Clamped to the tokens' full chunks: a count as large as msgpack carries names no more work than those.
        full = len(tokens) // self._engine.chunk_size
        first = min(args.first_chunk, full)
        chunks = range(first, min(first + args.num_chunks, full))
        self._engine.demote(tokens, chunks, namespace=namespace)
        return {"chunks": len(chunks)}

    def end_session(self, session: Session, _: NoArgs) -> dict[str, Any]:
        self._sessions.settle()  # as for unregister
        return self._end_session(session.id, "end_session")

    def clear(self, session: Session, _: NoArgs) -> dict[str, Any]:
        _not_for_tenants(session, "CLEAR drops every tenant's objects")
        self._engine.clear()
        return {}

    def stats(self, session: Session, _: NoArgs) -> dict[str, Any]:
        _not_for_tenants(session, "STATS counts every tenant's objects and sessions")
        self._sessions.settle()  # the counts include what the clients have seen done
        return {"server": self._server_stats(), "cache": self._engine.stats()}

    def _namespace(self, session: Session, registration: int | None, explicit: Namespace | None) -> CacheNamespace:
        """The key space a request names. One its tenant may not use is swapped for a key space of the tenant's own
        that nothing is ever stored in: a LOOKUP there misses (the same work and answer as any miss), a DEMOTE
        moves nothing. A registration's was checked when it was made."""
        if explicit is not None and registration is None:
            grants = session.grants
            foreign = grants is not None and not grants.allows(explicit.model, explicit.salt)
            fields = (tuple(explicit.__dict__.items()), grants.name if foreign and grants is not None else None)
            namespace = self._key_spaces.get(fields)
            if namespace is None:
                try:
                    fields_given = explicit.model_dump()
                    fields_given["codec"] = explicit.codec or self._engine.codec
                    if foreign and grants is not None:
                        log.info(
                            "tenant %s names model %r salt %r, not its own: its lookups there miss",
                            grants.name,
                            explicit.model,
                            explicit.salt,
                        )
                        # NUL: no salt a tenant may register holds one (`TenantGrants.allows`)
                        fields_given["salt"] = f"{explicit.salt}\0{grants.name}"
                    namespace = CacheNamespace(**fields_given)
                except ValueError as exc:
                    raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'namespace': {exc}") from None
                if len(self._key_spaces) >= _KEY_SPACES_KEPT:
                    self._key_spaces.clear()
                self._key_spaces[fields] = namespace
            return namespace
        if registration is None or explicit is not None:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "give exactly one of 'registration' and 'namespace'")
        reg = self._sessions.use_registration(session, registration)
        self._sessions.done_with(reg)
        return reg.namespace


_KEY_SPACES_KEPT = 1024


def _not_for_tenants(session: Session, why: str) -> None:
    if session.grants is not None:
        raise ProtocolError(ErrorCode.FORBIDDEN, f"{why}: not for a tenant ({session.grants.name})")


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
