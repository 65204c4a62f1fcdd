"""The cache engine: token prefixes -> chunk objects in the host pool, with locks, eviction and tiers.

One ``store`` or ``retrieve`` is one ``kvferry.transfer`` call for all of the request's chunks (bookkeeping is
per chunk, copying is not). Bad arguments raise ValueError/TypeError naming them, before any memory is touched;
a full pool, a failed tier or a corrupt object is a miss or a skipped chunk, counted in ``stats()``.

The engine is the API over its parts: lookups in `kvferry.cache.lookup`, stores in `writer`, retrieves in
`reader`, the pool's contents in `residency`, tier I/O in `tiering`, each call's KV geometry in `geometry_checks`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Unpack

from kvferry.cache.call_options import RetrieveOptions, StoreOptions
from kvferry.cache.event_hooks import EventSource
from kvferry.cache.event_queue import EventQueue
from kvferry.cache.geometry_checks import GeometryChecks
from kvferry.cache.index import object_checksum
from kvferry.cache.keys import CacheNamespace, ChunkHasher, TokenIds
from kvferry.cache.lookup import Located, LookupResult, PrefixLookup
from kvferry.cache.metrics import CacheCounters, engine_values, make_registry
from kvferry.cache.policies import make_policy
from kvferry.cache.pool_sizing import host_pool
from kvferry.cache.reader import ChunkReader
from kvferry.cache.residency import Residency
from kvferry.cache.steps import RecordedEvent, Steps, StoredEarly, StreamMarker, run_steps, submitted
from kvferry.cache.tiering import TierLink
from kvferry.cache.writer import ChunkWriter
from kvferry.cache.written import WrittenStores
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, KVGeometry
from kvferry.kernels.cpu_threads import torch_on_one_thread
from kvferry.memory import HostPool
from kvferry.tiers import Tier, make_tier
from kvferry.tiers.metrics import TierCollector
from kvferry.transfer.block_ids import BlockIds


class CacheEngine:
    """A KV cache of chunk objects in a host pool, keyed by token prefix, over optional storage tiers.

    Thread-safe. ``namespace`` (see ``namespace_for``) is the default key space of every call; a server that
    serves several models or ranks passes ``namespace=`` per call instead.
    """

    def __init__(
        self,
        config: KvferryConfig | None = None,
        *,
        pool: HostPool | None = None,
        tiers: Sequence[Tier] | None = None,
        namespace: CacheNamespace | None = None,
        name: str = "cache",
    ) -> None:
        self.config = config if config is not None else KvferryConfig()
        cfg = self.config.cache
        self.chunk_size = cfg.chunk_size
        self.namespace = namespace
        if pool is None:
            pool = host_pool(cfg.l1_size_gb, cfg.l1_size_bytes, cfg.l1_populate, cfg.shared_pool)
        self.pool = pool
        self.counters = CacheCounters()
        self._hasher = ChunkHasher(cfg.chunk_size, cfg.hash_algo)
        self._res = Residency(self.pool, make_policy(cfg.eviction_policy), cfg, self.counters)
        self._checksum = object_checksum if cfg.verify_checksums else None
        self._owned_tiers: list[Tier] = []
        if tiers is None and self.config.tiers:
            self._owned_tiers = [make_tier(url) for url in self.config.tiers]
            tiers = self._owned_tiers
        for tier in tiers or ():
            tier.use_memory(self.pool.slab)
        self._tiers = TierLink(list(tiers), self._res, cfg.tier_write, self._checksum) if tiers else None
        self._writer = ChunkWriter(
            self._res, self._hasher, cfg.chunk_size, self._checksum, self._tiers, cfg.in_flight_wait_s
        )
        # Stores copied by the engine itself into objects reserved in a shared pool (`kvferry.cache.written`).
        self.written = WrittenStores(self._writer, self._res, self._hasher, cfg.chunk_size)
        self._reader = ChunkReader(self._res, self._hasher, cfg.chunk_size, self._checksum, self.counters)
        self._lookup = PrefixLookup(self._res, self._hasher, self._tiers)
        self._geometries = GeometryChecks(cfg.chunk_size)
        # Its threads run torch on one thread each: a parallel op there would slow the engine's own (`cpu_threads`).
        self._executor = ThreadPoolExecutor(cfg.async_workers, f"kvferry-{name}", initializer=torch_on_one_thread)
        self._stored_early = StoredEarly()  # stores seen done at their copy's end: settled before the cache is read
        # The cache's counters and its tiers' (`kvferry_tier_*`, labelled by tier): one registry to export.
        self.metrics_registry = make_registry(name, self._metric_values)
        self.metrics_registry.register(TierCollector(lambda: [tier.metrics for tier in self.tiers]))
        self._closed = threading.Event()
        self._events: EventSource | None = None

    # --- keys ---------------------------------------------------------------------------------------------

    @property
    def codec(self) -> str:
        """The codec of chunk objects in key spaces that name none (the config's ``cache.codec``)."""
        return self.config.cache.codec

    def namespace_for(
        self,
        model: str,
        fmt: EngineKVFormat | int,
        paged: Any,
        *,
        world_size: int = 1,
        rank: int = 0,
        salt: str = "",
        block_size: int | None = None,
        geometry: KVGeometry | None = None,
        codec: str | None = None,
        kv_cache_dtype: str | None = None,
        group: str | None = None,
        split: str | None = None,
    ) -> CacheNamespace:
        """The key space of ``model``'s KV cache ``paged`` (in format ``fmt``) on ``rank`` of ``world_size``;
        ``kv_cache_dtype``, ``group`` and ``split`` name the KV within the deployment (see `CacheNamespace`).

        An engine that holds a slice of the model's heads (``geometry`` from ``describe(..., heads=)``) stores and
        reads its columns of objects that hold every head: their key space is the model's whatever the
        parallelism (``world_size`` and ``rank`` are not part of it), so every rank of a tensor-parallel engine,
        and an engine of another degree, shares the same objects.

        ``codec`` (default: the config's ``cache.codec``) is the codec of the objects this engine stores and reads:
        a ValueError saying why where its KV cache cannot take it."""
        codec = self.codec if codec is None else codec
        names = {"kv_cache_dtype": kv_cache_dtype, "group": group, "split": split}
        return self._geometries.namespace(model, fmt, paged, block_size, geometry, codec, world_size, rank, salt, names)

    def chunk_keys(self, tokens: TokenIds, *, namespace: CacheNamespace | None = None) -> list[bytes]:
        """The keys of the full chunks of ``tokens`` (what tiers see)."""
        return self._hasher.keys(tokens, self._ns(namespace))

    # --- lookup -------------------------------------------------------------------------------------------

    def lookup(
        self, tokens: TokenIds, *, namespace: CacheNamespace | None = None, block_size: int | None = None
    ) -> int:
        """Prefix tokens of ``tokens`` ready in the host pool: full chunks, then a stored tail (see
        `kvferry.cache.tails`) of whole ``block_size``-token blocks. Starts promoting tier hits."""
        return self.lookup_status(tokens, namespace=namespace, block_size=block_size).hit_tokens

    def lookup_status(
        self,
        tokens: TokenIds,
        *,
        namespace: CacheNamespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
        first_chunk: int = 0,
    ) -> LookupResult:
        """Like ``lookup``, and reports the tokens in flight from tiers; ``lock=True`` locks the hit chunks
        against eviction until ``retrieve(lock_id=...)`` / ``free_lookup_locks`` / the lock timeout.
        ``block_size``, ``first_chunk``: see ``lookup_pool``."""
        found, below = self.lookup_pool(
            tokens, namespace=namespace, lock=lock, block_size=block_size, first_chunk=first_chunk
        )
        return found if below is None else below()

    def lookup_pool(
        self,
        tokens: TokenIds,
        *,
        namespace: CacheNamespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
        first_chunk: int = 0,
        locate: bool = False,
    ) -> tuple[LookupResult, Callable[[], LookupResult] | None]:
        """``lookup_status`` in two halves: the pool's answer now, without touching a tier, and -- when tiers may
        hold the chunks after the pool's hits -- a function that asks them (it waits for the tiers' I/O, so a
        caller that must stay responsive runs it on another thread) and returns the whole answer. Tails
        (`kvferry.cache.tails`) count in whole ``block_size``-token blocks (None: any stored tail), the pool's
        only: while a tier holds chunks after the hit, the answer reports them pending.

        ``first_chunk``: the caller needs the chunks from this one on only (a sliding-window layer's lookup needs
        the window before the hit's end); the hit then counts from token 0 as if the chunks before it were held,
        and is ``first_chunk`` chunks where that chunk is missing.

        ``locate``: the hit is located as `locate` does (``LookupResult.located``, its read lease the lock), for a
        process that copies the objects itself; refused (ValueError) as `locate` is, and with a ``first_chunk``."""
        if locate:
            self._check_locatable()  # before anything is looked up or leased
            if first_chunk:
                raise ValueError("a located hit starts at the prefix's first chunk")
        self._stored_early.settle()
        return self._lookup.pool_then_tiers(tokens, self._ns(namespace), lock, block_size, first_chunk, locate)

    def locate(
        self, tokens: TokenIds, *, namespace: CacheNamespace | None = None, block_size: int | None = None
    ) -> Located:
        """The pool's prefix hit of ``tokens`` (as `lookup`, the pool only) for a process that copies the objects
        itself out of a shared pool (`HostPool.shared_fd`): where each object sits, under a read lease that keeps
        them as they are until ``free_lookup_locks(lease)`` or the lease's deadline, whatever else happens to them
        (evicted, cleared). A copy that ends after the deadline may have read other bytes: the copier checks.
        Refused (ValueError) where the cache verifies checksums: a located object is read without a check."""
        self._check_locatable()
        self._stored_early.settle()
        return self._lookup.locate(tokens, self._ns(namespace), block_size)

    @property
    def not_locatable(self) -> str | None:
        """Why this cache's objects cannot be located (`locate`), or None."""
        if self._checksum is not None:
            return "cache.verify_checksums is on: objects are verified as a retrieve reads them"
        return None

    def _check_locatable(self) -> None:
        why = self.not_locatable
        if why is not None:
            raise ValueError(why)

    @property
    def shared_pool(self) -> tuple[int, int] | None:
        """A shared pool's memfd (this process's descriptor) and size in bytes; None for a private pool."""
        fd = self.pool.shared_fd
        return None if fd is None else (fd, self.pool.capacity_bytes)

    def prefetch(self, tokens: TokenIds, *, namespace: CacheNamespace | None = None) -> Future[int]:
        """Start promoting the tier hits of ``tokens`` into the pool; the future gives the pool's prefix hit
        (as ``lookup`` would) once every promotion this prefix waits for has landed or missed."""
        self._stored_early.settle()
        return self._lookup.prefetch(tokens, self._ns(namespace))

    def demote(self, tokens: TokenIds, chunks: range, *, namespace: CacheNamespace | None = None) -> None:
        """Move the objects of chunks ``chunks`` of ``tokens``'s prefix to the front of the eviction order: worth
        less than the rest (only a lookup of a shorter prefix still needs them), so evicted first, not dropped."""
        if chunks:
            prefix = self._hasher.prefix(tokens, self._ns(namespace))
            self._res.demote([prefix.key(m) for m in chunks if m < prefix.n])

    def free_lookup_locks(self, lock_id: int) -> bool:
        """End a lookup lock without retrieving; False if it already ended (retrieved, freed or timed out)."""
        return self._res.release_lock(lock_id)

    def free_lookup_locks_many(self, lock_ids: Iterable[int]) -> int:
        """`free_lookup_locks` of each of ``lock_ids``, under one hold of the cache's lock (a lookup of pages takes
        one per page: 64 frees one by one cost an SGLang load ~0.1 ms of the H100 host's time); how many were
        still held."""
        return self._res.release_locks(lock_ids)

    # --- store / retrieve ---------------------------------------------------------------------------------

    def store(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        **options: Unpack[StoreOptions],
    ) -> int:
        """Copy the full chunks of ``tokens`` not cached yet out of the engine's blocks; returns tokens stored.
        ``options``: those of ``store_steps``."""
        return run_steps(self.store_steps(tokens, paged, block_ids, fmt, **options))

    def store_steps(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        namespace: CacheNamespace | None = None,
        block_size: int | None = None,
        skip_prefix_tokens: int = 0,
        geometry: KVGeometry | None = None,
        valid_until: float | None = None,
        tail: bool = False,
        pages: bool = False,
    ) -> Steps[int]:
        """``store`` as steps (`kvferry.cache.steps`): it yields once, when its copy is in flight (or done, on the
        CPU).

        ``block_ids`` holds the engine block of every ``block_size`` tokens from token 0. Chunks that lie
        entirely within ``skip_prefix_tokens`` are not stored. Chunks that find the pool full of locked or
        in-use objects are skipped (counted in ``stats()['skipped_chunks']``), never an exception.
        ``geometry`` (``kvferry.formats.describe(fmt, paged, block_size)``, made once at registration) saves
        re-validating the engine's tensors on every call. ``valid_until`` (time.time()): when the caller stops
        waiting and may reuse the blocks; chunks whose copy ends later are dropped, never cached with bytes that
        may be another request's (counted in ``stats()['late_chunks']``).

        An engine holding a slice of the model's heads writes its slice of each object (see ``namespace_for``):
        an object becomes readable once every head's slice is written, and is dropped if some are still missing
        ``slice_wait_s`` after the first (counted in ``stats()['expired_partial_chunks']``).

        ``tail=True`` also stores the tokens after the last full chunk, as many as fill whole blocks, as a tail
        object (`kvferry.cache.tails`): a later lookup of a prompt that goes on from them hits them too.

        ``pages=True``: each chunk of ``tokens`` is a page, stored under its key as a one-chunk prefix of its own
        (see ``retrieve_steps``), all in one copy (``skip_prefix_tokens`` 0, no tail).
        """
        ns = self._ns(namespace)
        geom = self._geometries.checked(fmt, paged, block_size, geometry, ns)
        return (
            yield from self._writer.store_steps(
                tokens, ns, paged, geom, block_ids, skip_prefix_tokens, valid_until, tail, pages
            )
        )

    def retrieve(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        **options: Unpack[RetrieveOptions],
    ) -> int:
        """Copy the cached prefix of ``tokens`` after ``skip_prefix_tokens`` into the engine's blocks.

        Returns the number of tokens written: tokens ``[skip_prefix_tokens, skip_prefix_tokens + n)`` now
        hold cached KV (0 on a miss). The engine's blocks before ``skip_prefix_tokens`` are not written.
        ``options``: those of ``retrieve_steps``.
        """
        return run_steps(self.retrieve_steps(tokens, paged, block_ids, fmt, **options))

    def retrieve_steps(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        namespace: CacheNamespace | None = None,
        block_size: int | None = None,
        skip_prefix_tokens: int = 0,
        lock_id: int | None = None,
        geometry: KVGeometry | None = None,
        pages: bool = False,
    ) -> Steps[int]:
        """``retrieve`` as steps (`kvferry.cache.steps`): it yields once its copy is in flight, a miss returns at
        once. ``lock_id`` (from ``lookup_status(lock=True)``) is released once the copy is enqueued (the copy then
        holds its chunks), or at its end whatever happens.

        ``pages=True``: each chunk of ``tokens`` is a page, keyed as a one-chunk prefix of its own (an engine that
        hands over pages keyed by a hash of all before them, as SGLang does); the leading pages the cache holds are
        loaded, one into each chunk's blocks, in one copy (``skip_prefix_tokens`` 0, no tail).
        """
        try:
            self._stored_early.settle()
            ns = self._ns(namespace)
            geom = self._geometries.checked(fmt, paged, block_size, geometry, ns)
        except BaseException:
            if lock_id is not None:
                self._res.release_lock(lock_id)
            raise
        return (
            yield from self._reader.read_steps(tokens, ns, paged, geom, block_ids, skip_prefix_tokens, lock_id, pages)
        )

    def store_async(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        after: RecordedEvent | None = None,
        start_here: bool = False,
        marks: StreamMarker | None = None,
        **options: Unpack[StoreOptions],
    ) -> Future[int]:
        """``store`` on the engine's worker threads; the engine must leave those blocks alone until done.

        ``after``: a CUDA event the caller recorded after the work that writes the blocks (its stream is not the
        worker thread's); the GPU copy waits for it on the GPU. Without one it is ordered after the worker
        thread's current stream. ``start_here``: run up to the copy in flight on this thread instead, ordered
        after its current stream (no hand-off before the first GPU operation); only what comes after (the wait,
        a tail's copy) goes to the workers, after ``after``, or, with ``marks``, after a mark of this thread's
        stream recorded once the copy is in flight. A failure before the copy is the future's."""
        request = (tokens, paged, block_ids, fmt)
        future = submitted(
            self._executor, self.store, self.store_steps, request, dict(options), after, start_here, marks
        )
        self._stored_early.add(future)
        return future

    def retrieve_async(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        after: RecordedEvent | None = None,
        start_here: bool = False,
        marks: StreamMarker | None = None,
        **options: Unpack[RetrieveOptions],
    ) -> Future[int]:
        """``retrieve`` on the engine's worker threads; the blocks hold the KV once the future is done. ``after``,
        ``start_here``, ``marks``: as for ``store_async`` (``after``: the last work that reads the blocks before
        they are written)."""
        request, steps = (tokens, paged, block_ids, fmt), self.retrieve_steps
        return submitted(self._executor, self.retrieve, steps, request, dict(options), after, start_here, marks)

    # --- administration -----------------------------------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        """The storage tiers below the pool, in lookup order."""
        return self._tiers.tiers if self._tiers is not None else []

    def clear(self) -> None:
        """Drop every object in the pool and every lookup lock (objects being copied go when their copy ends)."""
        self._res.clear()

    def publish_events(self, queue: EventQueue) -> EventSource:
        """Report KV events (`kvferry.cache.event_hooks`) into ``queue`` from now on, starting with ``AllCleared``
        and a store for every object held now (the pool's, and the tiers' that survived a restart). Once."""
        if self._events is not None:
            raise RuntimeError("this cache engine publishes its events already")
        self._events = EventSource(self._res, self.tiers, queue)
        self._events.resync()
        return self._events

    def stats(self) -> dict[str, Any]:
        values: dict[str, Any] = self._metric_values()
        values["pool"] = self.pool.stats()
        values["tiers"] = [t.stats() for t in self.tiers]  # no tier I/O: what each tier last saw
        return values

    def close(self) -> None:
        """Finish queued async work and close the tiers this engine opened from its config."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._executor.shutdown(wait=True)
        for tier in self._owned_tiers:
            tier.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------------------

    def _ns(self, namespace: CacheNamespace | None) -> CacheNamespace:
        ns = namespace if namespace is not None else self.namespace
        if not isinstance(ns, CacheNamespace):
            raise ValueError(
                f"namespace={ns!r}: pass a CacheNamespace (see CacheEngine.namespace_for) per call "
                "or to CacheEngine(namespace=...)"
            )
        return ns

    def _metric_values(self) -> dict[str, float]:
        return engine_values(self._res, self.chunk_size, self._events.queue.dropped if self._events else 0)


__all__ = ["CacheEngine", "LookupResult"]
