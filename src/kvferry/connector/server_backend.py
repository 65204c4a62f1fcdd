"""A ``kvferry server`` as a connector's backend: lookups, loads and stores through a `ServerLink`'s session.

Lookups name the key space explicitly (a scheduler in another process holds no KV, and a worker's lookups are
the same requests); a windowed group's lookups ask for its window only (LOOKUP's ``first_chunk``), and chunks a
newer boundary supersedes are demoted on the server (DEMOTE), as in embedded mode (`window_groups`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvferry.cache.keys import TokenIds
from kvferry.client import KvferryClient, ServerError
from kvferry.client.records import LocateResult, LookupResult, Reserved
from kvferry.connector.backends import Hit, KeySpace, plus
from kvferry.connector.direct_loads import DirectLoads
from kvferry.connector.direct_stores import DirectStores
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.server_link import ServerDown, ServerLink
from kvferry.protocol.messages import ErrorCode

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServerBackend:
    """A ``kvferry server`` behind a `ServerLink` (misses while it is down). With ``kv`` the link registers the
    engine's KV cache (the worker), whose kernel block ids the loads and stores name; without, it only looks up (a
    scheduler in another process), or its link registers KV made once connected (a Mamba state's, whose blocks
    are vLLM's: `worker_backend.make_state_backend`)."""

    def __init__(
        self,
        link: ServerLink,
        key_space: KeySpace,
        kv: EngineKV | None = None,
        *,
        block_size: int | None = None,
        direct: DirectLoads | None = None,
        direct_stores: DirectStores | None = None,
        locate_hits: bool = False,
    ) -> None:
        """``block_size``: the scheduler's, in which a tail hit counts (None: ``kv``'s). ``direct``: loads copied
        here out of the server's shared pool (`kvferry.connector.direct_loads`), RETRIEVE where it cannot;
        ``direct_stores``: stores copied here into it (`kvferry.connector.direct_stores`), STORE where not.
        ``locate_hits``: lookups ask the server to locate their hits (`Hit.located`), which a worker's direct loads
        then copy with no LOCATE on the load's path; a server that will not still answers the lookup."""
        self._direct = direct
        self._locate_hits = locate_hits
        self.direct_stores = direct_stores
        self.link = link
        self.key_space = key_space
        self._kv = kv
        self._block_size = block_size if block_size is not None or kv is None else kv.block_size * kv.split
        self._namespaces: dict[int, dict[str, Any]] = {}
        self._older: set[str] = set()  # request forms this server refused as one that predates them

    @property
    def chunk_size(self) -> int | None:
        return None if self.link.incompatible else self.link.chunk_size

    def lookup(self, tokens: TokenIds, first_chunk: int = 0) -> Hit | None:
        try:
            generation, namespace = self.link.generation, self._namespace()

            def send(client: KvferryClient, locate: bool) -> Future[LookupResult]:
                return client.lookup_async(
                    tokens, namespace=namespace, lock=True, block_size=self._block_size, first_chunk=first_chunk,
                    locate=locate,
                )  # fmt: skip

            found = None
            if self._locate_hits and not first_chunk:
                found = self._unless_older("locate", ErrorCode.BAD_ARGUMENT, lambda client, _: send(client, True))
            if found is None:
                found = self.link.wait(lambda client, _: send(client, False), self.link.timeout_s)
        except ServerDown:
            return Hit(0)
        except Exception as exc:
            log.warning("kvferry: lookup at %s failed (a miss): %s: %s", self.link.url, type(exc).__name__, exc)
            return Hit(0)
        return self._hit(found, generation)

    def lookup_each(self, prompts: Sequence[TokenIds]) -> list[Hit | None]:
        """`lookup` of each of ``prompts`` (SGLang's pages, say), in one LOOKUP_EACH (a server that predates it: one
        LOOKUP each, sent together, the replies in one round trip's time). A lookup that fails is a miss."""
        try:
            generation, namespace = self.link.generation, self._namespace()
            if len(prompts) > 1:
                found = self._unless_older(
                    "LOOKUP_EACH",
                    ErrorCode.UNKNOWN_OP,
                    lambda client, _: client.lookup_each_async(
                        prompts, namespace=namespace, lock=True, block_size=self._block_size
                    ),
                )
                if found is not None:
                    return [self._hit(one, generation) for one in found]
            futures = self.link.call(
                lambda client, _: [
                    client.lookup_async(tokens, namespace=namespace, lock=True, block_size=self._block_size)
                    for tokens in prompts
                ]
            )
        except ServerDown:
            return [Hit(0)] * len(prompts)
        except Exception as exc:
            log.warning("kvferry: lookups at %s failed (misses): %s: %s", self.link.url, type(exc).__name__, exc)
            return [Hit(0)] * len(prompts)
        deadline = time.monotonic() + self.link.timeout_s
        hits: list[Hit | None] = []
        for future in futures:
            try:
                one = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                log.warning("kvferry: lookup at %s failed (a miss): %s: %s", self.link.url, type(exc).__name__, exc)
                hits.append(Hit(0))
            else:
                hits.append(self._hit(one, generation))
        return hits

    def _hit(self, found: LookupResult, generation: int) -> Hit | None:
        """A server's lookup result as a hit (its lock tagged with the link's generation); None while chunks after
        it are still coming up from a tier (its lock freed)."""
        lock = None if found.lock is None else (generation, found.lock)
        if found.pending:
            self.free_lock(lock)
            return None
        return Hit(found.tokens, lock, found.located)

    def free_lock(self, lock: Any) -> None:
        self.free_locks([lock])

    def free_locks(self, locks: Sequence[Any]) -> None:
        """`free_lock` of each of ``locks``, in one request (a lookup of SGLang's pages holds one a page: 64 requests
        kept the engine's thread and the server's socket thread busy right after each load). A server that
        predates that form gets one request a lock, sent together."""
        # a lock taken from a server since gone (or restarted) went with it
        ids = [lock[1] for lock in locks if lock is not None and lock[0] == self.link.generation]
        if not ids:
            return
        try:
            if len(ids) > 1:
                freed = self._unless_older(
                    "locks", ErrorCode.BAD_ARGUMENT, lambda client, _: client.free_lookup_locks_many_async(ids)
                )
                if freed is not None:
                    return
            futures = self.link.call(lambda client, _: [client.free_lookup_locks_async(i) for i in ids])
            deadline = time.monotonic() + self.link.timeout_s
            for future in futures:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # an expired lock, or the server went away: nothing to free any more
            log.debug("kvferry: freeing lookup locks %s: %s", ids, exc)

    def _unless_older(
        self, form: str, refusal: ErrorCode, send: Callable[[KvferryClient, int | None], Future[T]]
    ) -> T | None:
        """``send``'s request waited for; None where the server predates ``form`` (a request or an argument that it
        refuses with ``refusal``): the caller then sends the older form, and ``form`` is not tried again."""
        if form in self._older:
            return None
        try:
            return self.link.wait(send, self.link.timeout_s)
        except ServerError as exc:
            if exc.code != refusal.value:
                raise
            self._older.add(form)
            return None

    def retrieve_async(
        self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int, located: LocateResult | None = None
    ) -> Future[int]:
        """``located``: the scheduler's lookup located the hit (`Hit.located`), which a direct load copies."""
        if self._direct is not None:
            direct = self._direct_load(tokens, block_ids, skip_prefix_tokens, located)
            if direct is not None:
                return direct
        ids = self._kernel_block_ids(block_ids)
        written = self.link.submit(
            lambda client, reg: client.retrieve_async(
                _registered(reg), tokens, ids, skip_prefix_tokens=skip_prefix_tokens
            )
        )
        return plus(written, skip_prefix_tokens)

    def retrieve_pages_async(self, tokens: TokenIds, block_ids: list[int]) -> Future[int]:
        """As `EmbeddedBackend.retrieve_pages_async`, in one RETRIEVE."""
        ids = self._kernel_block_ids(block_ids)
        return self.link.submit(lambda client, reg: client.retrieve_async(_registered(reg), tokens, ids, pages=True))

    def store_pages_async(self, tokens: TokenIds, block_ids: list[int]) -> Future[int]:
        """As `EmbeddedBackend.store_pages_async`, in one STORE."""
        ids = self._kernel_block_ids(block_ids)
        return self.link.submit(lambda client, reg: client.store_async(_registered(reg), tokens, ids, pages=True))

    def retrieve(
        self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int, located: LocateResult | None = None
    ) -> int:
        """Sent and waited for on this thread: it reads the server's answer and watches the transfer's done flag
        itself (the asynchronous form's future passes through the client's threads on the way back)."""
        if self._direct is not None:
            direct = self._direct_load(tokens, block_ids, skip_prefix_tokens, located, wait_here=True)
            if direct is not None:
                return direct.result()
        ids = self._kernel_block_ids(block_ids)
        written = self.link.call(
            lambda client, reg: client.retrieve(_registered(reg), tokens, ids, skip_prefix_tokens=skip_prefix_tokens)
        )
        return skip_prefix_tokens + written

    def _direct_load(
        self,
        tokens: TokenIds,
        block_ids: list[int],
        skip: int,
        located: LocateResult | None,
        *,
        wait_here: bool = False,
    ) -> Future[int] | None:
        """The load copied here (`DirectLoads.start`): of ``located`` (the scheduler's lookup's, whose lease the
        scheduler ends), else of what a LOCATE finds now. None where the server will not locate (its pool is
        private, its objects coded or checksummed, this client a tenant's) or its pool cannot be mapped here
        (another user's or host's server): then this and every later load goes through RETRIEVE, said once. None
        too for a pool of a server since gone (located before a restart): this load goes through RETRIEVE."""
        direct = self._direct
        assert direct is not None
        release = _nothing
        if located is None or located.tokens != len(tokens):
            generation = self.link.generation
            try:
                located = self.link.call(  # the reply read on this thread, as `retrieve`'s is
                    lambda client, reg: client.locate(tokens, registration=reg, block_size=self._block_size)
                )
            except ServerError as exc:
                if not is_refusal(exc):
                    raise
                self._no_direct_loads(f"the server at {self.link.url} does not locate: {exc}")
                return None
            lease = located.lease

            def release() -> None:
                if lease is not None:
                    self.free_leases(generation, [lease])

        try:
            return direct.start(located, block_ids, skip, self.link.chunk_size or 0, release, wait_here=wait_here)
        except OSError as exc:
            if os.path.exists(f"/proc/{located.pool[0]}"):
                self._no_direct_loads(f"its pool cannot be mapped here: {exc}")
            return None

    def _no_direct_loads(self, why: str) -> None:
        log.warning("kvferry: loads go through RETRIEVE, not direct: %s", why)
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()

    def free_leases(self, generation: int, leases: list[int]) -> None:
        """End read leases taken at link ``generation`` without waiting for the answer (a restarted server's are
        gone with it)."""
        if generation != self.link.generation:
            return
        try:
            self.link.call(lambda client, _: [client.free_lookup_locks_many_async(leases)])
        except Exception as exc:  # the server went away: its leases with it
            log.debug("kvferry: ending read leases %s: %s", leases, exc)

    def store_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        # Sent from vLLM's thread: the client records the STORE's ready event on vLLM's current stream, after the
        # forward pass that wrote the blocks, and the server's copy waits for it on the GPU (a direct store's copy
        # is ordered after that stream here).
        if self.direct_stores is not None:
            direct = self._direct_store(self.direct_stores, tokens, block_ids, skip_prefix_tokens)
            if direct is not None:
                return direct
        ids = self._kernel_block_ids(block_ids)
        return self.link.submit(
            lambda client, reg: client.store_async(
                _registered(reg), tokens, ids, skip_prefix_tokens=skip_prefix_tokens, tail=True
            )
        )

    def _direct_store(
        self, stores: DirectStores, tokens: TokenIds, block_ids: list[int], skip: int
    ) -> Future[int] | None:
        """The store copied here (`DirectStores.start`); None where the objects reserved for it cannot hold it
        (then more are asked for) or direct stores are off."""
        generation = self.link.generation

        def commit(
            tokens: TokenIds, first: int, objects: list[int], tail: tuple[int, int] | None, refill: int
        ) -> Future[Reserved]:
            return self.link.submit(
                lambda client, reg: client.commit_async(
                    _registered(reg), tokens, objects, first_chunk=first, tail=tail, refill=refill
                )
            )

        chunk = self.link.chunk_size
        if chunk is None:  # not connected yet: the STORE fails as a store to a server that is down does
            return None
        direct = stores.start(tokens, block_ids, skip, chunk, generation, commit)
        if direct is None and not stores.off:
            stores.refill(
                generation,
                lambda count: self.link.submit(lambda client, reg: client.reserve_async(_registered(reg), count)),
            )
        return direct

    def demote(self, tokens: TokenIds, chunks: range) -> None:
        """Sent without waiting (a store's callback calls it): a demotion that fails, or a server that predates
        DEMOTE, leaves only the plain eviction order."""
        if not chunks:
            return
        sent = self.link.submit(lambda client, _: client.demote_async(tokens, chunks, namespace=self._namespace()))
        sent.add_done_callback(_log_failed_demotion)

    def _kernel_block_ids(self, block_ids: list[int]) -> list[int] | Any:
        return block_ids if self._kv is None else self._kv.kernel_block_ids(block_ids)

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        if self.direct_stores is not None:
            self.direct_stores.close()
        self.link.close()

    def _namespace(self) -> dict[str, Any]:
        chunk_size = self.link.chunk_size
        assert chunk_size is not None  # the link is up, so the server told it
        if chunk_size not in self._namespaces:
            namespace = self.key_space.namespace(chunk_size)
            names = ("model", "kv_dtype", "layout", "world_size", "rank", "salt", "kv_cache_dtype", "group", "split")
            fields = {name: getattr(namespace, name) for name in names if getattr(namespace, name) is not None}
            if self.key_space.codec is not None:  # else the server's cache.codec, as for the registration
                fields["codec"] = self.key_space.codec
            self._namespaces[chunk_size] = fields
        return self._namespaces[chunk_size]


def _log_failed_demotion(sent: Future[int]) -> None:
    exc = sent.exception()
    if exc is not None and not isinstance(exc, ServerDown):
        log.debug("kvferry: demoting superseded chunks failed: %s: %s", type(exc).__name__, exc)


def _nothing() -> None:
    pass


def is_refusal(exc: BaseException) -> bool:
    """Whether a server's answer refuses a request it will always refuse (a private pool, a tenant, a server that
    predates the request)."""
    refusals = (ErrorCode.BAD_ARGUMENT.value, ErrorCode.FORBIDDEN.value, ErrorCode.UNKNOWN_OP.value)
    return isinstance(exc, ServerError) and exc.code in refusals


def _registered(registration: int | None) -> int:
    if registration is None:
        raise RuntimeError("this connector half registered no KV cache with the kvferry server")
    return registration
