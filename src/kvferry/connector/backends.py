"""The connector's backend interface, and the backend that keeps the cache in this process.

A backend is where an engine's KV goes: a cache engine in this process (`EmbeddedBackend`), or a ``kvferry
server`` through the client (`server_backend.ServerBackend`). Its two halves serve the engine's two halves:
`Lookups` the scheduler (which prompt tokens are cached), `Transfers` the worker (move them between the engine's
registered blocks and the cache); `Backend` is both. The worker creates the backend when the engine registers its
KV cache (`worker_backend`). A scheduler in the same process finds it in this process's registry (`publish`,
`find`); one in another process looks up through a `ServerBackend` of its own, without KV, in the key space the
worker reported at start-up (`KeySpace`).

The invariants every backend keeps (and the wrappers over a hybrid model's groups: `kv_groups`, `window_groups`,
`state_groups`, `layer_parts`):

- **Never raise into the engine.** A failed lookup is a miss; a failed load or store is a failed future (or, for
  `Transfers.retrieve`, an exception on the caller's thread that the worker side turns into a short load).
- **Locks.** A hit's tokens stay pinned against eviction from `Lookups.lookup` until `Lookups.free_lock`, called
  exactly once per hit whether or not the load ran; a load of an unlocked prefix may come back short.
- **A short load leaves only whole chunks written.** A load resolves to how many leading tokens the blocks then
  hold (a multiple of the chunk size, or ``len(tokens)``); blocks after that may hold anything and the engine
  recomputes them.
- **Ordering against the engine's stream.** A load or store is ordered after the work queued on the caller's
  current stream when it is issued (on a GPU: a ready event recorded there, waited for on the device), so blocks
  just freed by a request whose kernels are still queued are not overwritten early, nor read before written.
- **Blocks stay the caller's.** The caller keeps a store's blocks unchanged until its future is done, and a
  load's until it is done; a backend keeps no reference to the block ids after that.
- **Thread-safety.** `lookup` / `free_lock` are called from the scheduler's thread, transfers from the worker's
  (and their futures resolve on the backend's threads); a backend serialises what it shares between them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvferry.cache import CacheEngine, CacheNamespace
from kvferry.cache.call_options import TransferOptions
from kvferry.cache.keys import TokenIds
from kvferry.cache.request import dtype_name, layout_name
from kvferry.client.records import LocateResult
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.state_rows import row_bytes
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.codec import with_codec
from kvferry.transfer.api import prepare_gpu
from kvferry.transfer.stream_marks import StreamMarks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeySpace:
    """The cache key space of an engine's KV without the chunk size, in plain fields: what the worker tells a
    scheduler in another process, which learns the chunk size from the server.

    A Mamba state's (`state_groups`) gives ``state_bytes`` and ``page_bytes`` instead of a ``width``: its rows'
    width follows the chunk size (`state_rows.row_bytes`). A tensor-parallel rank's state is a shard of its own,
    so its key space names ``world_size`` and ``rank`` (attention KV's objects hold every head: it names neither).
    ``kv_cache_dtype``, ``group`` and ``split`` name the KV within the deployment (`CacheNamespace`'s fields).
    """

    model: str
    salt: str
    fmt: str  # EngineKVFormat name
    kv_dtype: str
    kv_size: int
    num_layers: int
    width: int
    codec: str | None = None  # the objects' codec; None: the server's `cache.codec`
    state_bytes: int = 0
    page_bytes: int = 0
    world_size: int = 1
    rank: int = 0
    kv_cache_dtype: str | None = None
    group: str | None = None  # `KVGroup.tag`
    split: str | None = None  # `LayerSplit.tag`

    @classmethod
    def of(
        cls,
        kv: EngineKV,
        *,
        model: str,
        salt: str,
        codec: str | None = None,
        group: str | None = None,
        split: str | None = None,
    ) -> KeySpace:
        geometry = describe(kv.fmt, kv.paged, kv.block_size, heads=kv.heads)
        kv_size, num_layers, _, width = geometry.object_shape(1)  # every head's width, on any rank
        dtype = dtype_name(geometry.dtype)
        # fp8 caches of either encoding are uint8 tensors: the encoding splits the keys
        kv_cache_dtype = kv.kv_dtype if kv.kv_dtype != dtype else None
        return cls(
            model, salt, kv.fmt.name, dtype, kv_size, num_layers, width, codec,
            kv_cache_dtype=kv_cache_dtype, group=group, split=split,
        )  # fmt: skip

    def namespace(self, chunk_size: int) -> CacheNamespace:
        """The key space (codec ``none`` where the server's applies: see `ServerBackend`, which leaves it out)."""
        width = row_bytes(self.state_bytes, self.page_bytes, chunk_size) if self.state_bytes else self.width
        layout = layout_name(EngineKVFormat[self.fmt], (self.kv_size, self.num_layers, chunk_size, width))
        return CacheNamespace(
            self.model, self.kv_dtype, layout, self.world_size, self.rank, self.salt, self.codec or "none",
            kv_cache_dtype=self.kv_cache_dtype, group=self.group, split=self.split,
        )  # fmt: skip

    def tags(self) -> dict[str, str]:
        """The fields that name the KV within the deployment, those set: what a server's key space adds to the
        model and salt (`kvferry.server.requests.Deployment`)."""
        named = {"kv_cache_dtype": self.kv_cache_dtype, "group": self.group, "split": self.split}
        return {name: value for name, value in named.items() if value is not None}

    def deployment(self) -> dict[str, str]:
        """The key space a server registration names: the model, the salt, the tags and the codec where one is
        asked for (`kvferry.server.requests.Deployment`; the server's own codec applies otherwise)."""
        named = {"model": self.model, "salt": self.salt, **self.tags()}
        return named if self.codec is None else {**named, "codec": self.codec}

    def fields(self) -> dict[str, Any]:
        """The fields by name, plain values: `KeySpace(**fields)` is this key space again."""
        return asdict(self)


@dataclass(frozen=True)
class Hit:
    """Leading prompt tokens the cache holds (full chunks, then a stored tail of whole scheduler blocks: see
    `kvferry.cache.tails`); ``lock`` pins them until `free_lock`. ``located``: where a server's shared pool holds
    them, under ``lock`` (a read lease), for a worker that copies them itself (`ServerBackend`'s direct loads)."""

    tokens: int
    lock: Any = None
    located: LocateResult | None = None


class Lookups(Protocol):
    """What the scheduler half needs of a backend (or of a hybrid model's backends together)."""

    @property
    def chunk_size(self) -> int | None:
        """The cache's chunk size; None while a server was never reached."""
        ...

    def lookup(self, tokens: TokenIds) -> Hit | None:
        """The cached prefix of ``tokens``, locked against eviction; None while chunks right after it are still
        coming up from a lower tier (ask again later). Never raises: a failure is a miss."""
        ...

    def free_lock(self, lock: Any) -> None: ...

    def close(self) -> None: ...


class Transfers(Protocol):
    """What the worker half needs of a backend: moving KV between the engine's registered blocks and the cache."""

    def retrieve_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """Load the cached prefix of ``tokens`` into ``block_ids`` (the first ``skip_prefix_tokens`` are already
        there); resolves to how many leading tokens the blocks then hold (the skipped prefix included), a multiple
        of the chunk size or ``len(tokens)``."""
        ...

    def retrieve(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> int:
        """`retrieve_async` to the end, for a caller that waits for it anyway (a foreground load): a backend may
        run it on the calling thread, ordered after its current stream, without a hand-off to a worker thread."""
        ...

    def store_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """Store the KV of ``tokens`` held in ``block_ids``: full chunks, and the tokens after them (whole blocks)
        as a tail object; the caller keeps the blocks unchanged until the future is done."""
        ...


class Backend(Lookups, Transfers, Protocol):
    """Both halves, and what only an in-process backend or a server can do besides."""

    def lookup(self, tokens: TokenIds, first_chunk: int = 0) -> Hit | None:
        """As `Lookups.lookup`; ``first_chunk``: the caller needs the chunks from this one on only (a backend may
        still ask for every chunk from token 0)."""
        ...

    def demote(self, tokens: TokenIds, chunks: range) -> None:
        """Chunks ``chunks`` of ``tokens``'s prefix go first when the cache evicts (see `CacheEngine.demote`)."""
        ...


class EmbeddedBackend:
    """A `CacheEngine` owned by this worker process.

    On a GPU each load and store is ordered, on the GPU, after what vLLM's stream had queued when the connector
    asked for it (the forward pass that wrote the blocks a store reads, or the last reader of the blocks a load
    writes): a store's copy and a foreground load are enqueued on the calling thread, after its current stream;
    what runs later on the engine's worker threads (a background load, a store's tail) waits for an event recorded
    there. Nothing waits on the CPU for the model."""

    def __init__(
        self, engine: CacheEngine, kv: EngineKV, namespace: CacheNamespace, key_space: KeySpace | None = None
    ) -> None:
        self.engine = engine
        self.kv = kv
        self.namespace = namespace
        self.key_space = key_space
        self.chunk_size: int | None = engine.chunk_size
        # Validated once here: every load and store then skips re-describing vLLM's tensors.
        self.geometry = describe(kv.fmt, kv.paged, kv.block_size, heads=kv.heads)
        self.scheduler_block_size = kv.block_size * kv.split  # a tail hit counts in these blocks
        self._on_gpu = self.geometry.device.type == "cuda"
        self._marks = StreamMarks(self.geometry.device) if self._on_gpu else None
        if self._on_gpu:  # as a server does at a registration: no transfer pays Triton's compile or the plan's build
            prepare_gpu(with_codec(self.geometry, namespace.codec))

    def lookup(self, tokens: TokenIds, first_chunk: int = 0) -> Hit | None:
        try:
            status = self.engine.lookup_status(
                tokens,
                namespace=self.namespace,
                lock=True,
                block_size=self.scheduler_block_size,
                first_chunk=first_chunk,
            )
        except Exception:
            log.exception("kvferry: lookup failed (counted as a miss)")
            return Hit(0)
        if status.pending_tokens:
            if status.lock_id is not None:
                self.engine.free_lookup_locks(status.lock_id)
            return None
        return Hit(status.hit_tokens, status.lock_id)

    def lookup_each(self, prompts: Sequence[TokenIds]) -> list[Hit | None]:
        """`lookup` of each of ``prompts`` (as `ServerBackend.lookup_each`, which sends them together)."""
        return [self.lookup(tokens) for tokens in prompts]

    def free_lock(self, lock: Any) -> None:
        self.engine.free_lookup_locks(lock)

    def free_locks(self, locks: Sequence[Any]) -> None:
        self.engine.free_lookup_locks_many(lock for lock in locks if lock is not None)

    def demote(self, tokens: TokenIds, chunks: range) -> None:
        self.engine.demote(tokens, chunks, namespace=self.namespace)

    def retrieve_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        written = self._marked(
            self.engine.retrieve_async, self._request(tokens, block_ids), self._options(skip_prefix_tokens), False
        )
        return plus(written, skip_prefix_tokens)

    def retrieve_pages_async(self, tokens: TokenIds, block_ids: list[int]) -> Future[int]:
        """Load pages into ``block_ids``, one copy for all: each chunk of ``tokens`` a page keyed as a one-chunk
        prefix of its own (`CacheEngine.retrieve_steps`' ``pages``); resolves to the tokens of the leading pages
        the cache held, all of them loaded. On a GPU the copy is enqueued on the calling thread, after its current
        stream (no thread hand-off before the first DMA)."""
        options = {**self._options(0), "pages": True}
        return self._marked(self.engine.retrieve_async, self._request(tokens, block_ids), options, True)

    def store_pages_async(self, tokens: TokenIds, block_ids: list[int]) -> Future[int]:
        """Store pages held in ``block_ids``, one copy for all, each chunk of ``tokens`` under its key alone (the
        pages `retrieve_pages_async` loads); on a GPU enqueued as they are."""
        options = {**self._options(0), "pages": True}
        return self._marked(self.engine.store_async, self._request(tokens, block_ids), options, True)

    def retrieve(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> int:
        """On a GPU, on the calling thread: the copy is ordered after its current stream (vLLM's) by the transfer
        itself, and the load saves two thread hand-offs (~0.3 ms of a 16-chunk load on the H200 host). On the CPU
        through the worker threads, whose torch runs on one thread (`cpu_threads`)."""
        if not self._on_gpu:
            return self.retrieve_async(tokens, block_ids, skip_prefix_tokens).result()
        written = self.engine.retrieve(*self._request(tokens, block_ids), **self._options(skip_prefix_tokens))
        return skip_prefix_tokens + written

    def _request(self, tokens: TokenIds, block_ids: list[int]) -> tuple[Any, ...]:
        """A transfer's positional arguments: the tokens, vLLM's tensors, their block ids, the format."""
        return tokens, self.kv.paged, self.kv.kernel_block_ids(block_ids), self.kv.fmt

    def _options(self, skip_prefix_tokens: int) -> TransferOptions:
        return {"namespace": self.namespace, "skip_prefix_tokens": skip_prefix_tokens, "geometry": self.geometry}

    def store_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """On a GPU the chunks' copy is enqueued on the calling thread, after its current stream (vLLM's: the
        forward that wrote the blocks), with no hand-off before its first DMA."""
        options = {**self._options(skip_prefix_tokens), "tail": True}
        return self._marked(self.engine.store_async, self._request(tokens, block_ids), options, True)

    def _marked(
        self, start: Callable[..., Future[int]], request: tuple[Any, ...], options: Mapping[str, Any], here: bool
    ) -> Future[int]:
        """``start(*request, **options)`` (the engine's `store_async` or `retrieve_async`). On a GPU ordered after
        the calling thread's current stream (vLLM's): with ``here`` started on this thread up to its copy in flight
        (`CacheEngine.store_async`'s ``start_here``), the rest on the engine's workers after a mark of that stream
        made once the copy is in flight; else all on the workers, after a mark made now (back to its pool once the
        transfer has ended). On the CPU on the engine's workers."""
        if self._marks is None:
            return start(*request, **options)
        if here:
            return start(*request, **options, start_here=True, marks=self._marks)
        mark = self._marks.record()
        try:
            future = start(*request, **options, after=mark)
        except BaseException:
            mark.release()
            raise
        future.add_done_callback(mark.release)
        return future

    def close(self) -> None:
        self.engine.close()
        if self._marks is not None:
            self._marks.close()


def plus(future: Future[int], offset: int) -> Future[int]:
    """``future``'s result plus ``offset``, as a future (its exception passed on)."""
    out: Future[int] = Future()

    def chain(done: Future[int]) -> None:
        exc = done.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(offset + done.result())

    future.add_done_callback(chain)
    return out


_registry: dict[str, Lookups] = {}
_registry_lock = threading.Lock()


def publish(engine_id: str, backend: Lookups) -> None:
    """Make ``backend`` the one of vLLM engine ``engine_id`` in this process."""
    with _registry_lock:
        if engine_id in _registry:
            raise RuntimeError(f"vLLM engine {engine_id!r} already registered its KV cache with kvferry")
        _registry[engine_id] = backend


def find(engine_id: str) -> Lookups | None:
    with _registry_lock:
        return _registry.get(engine_id)


def withdraw(engine_id: str) -> Lookups | None:
    with _registry_lock:
        return _registry.pop(engine_id, None)
