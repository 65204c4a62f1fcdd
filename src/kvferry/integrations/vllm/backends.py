"""Where the connector's KV goes: a cache engine in this process, or a ``kvferry server`` through the client.

Both give the scheduler half ``lookup`` (which locks the hit) and ``free_lock``, and the worker half
``retrieve_async`` / ``store_async`` on the engine's registered KV. The worker half creates the backend when vLLM
registers its KV cache. When vLLM runs the scheduler half in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
or a GPU engine with one worker) it finds the backend in this process's registry; otherwise (vLLM's CPU backend
runs its worker in a process of its own) the scheduler half looks up through a `ServerBackend` of its own, without
KV, in the key space the worker reported at start-up (`KeySpace`).

A backend never raises into vLLM: a failed lookup is a miss, a failed load or store a failed future.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from kvferry.cache import CacheEngine, CacheNamespace
from kvferry.cache.request import dtype_name, layout_name
from kvferry.config import TransferConfig
from kvferry.formats import EngineKVFormat, describe, with_codec
from kvferry.integrations.vllm.kv_layout import EngineKV
from kvferry.integrations.vllm.server_link import ServerDown, ServerLink
from kvferry.integrations.vllm.settings import ConnectorSettings
from kvferry.transfer import configure_gpu

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeySpace:
    """The cache key space of an engine's KV without the chunk size, in plain fields: what the worker tells a
    scheduler in another process, which learns the chunk size from the server."""

    model: str
    salt: str
    fmt: str  # EngineKVFormat name
    kv_dtype: str
    kv_size: int
    num_layers: int
    width: int
    codec: str | None = None  # the objects' codec; None: the server's `cache.codec`

    @classmethod
    def of(cls, kv: EngineKV, *, model: str, salt: str, codec: str | None = None) -> KeySpace:
        geometry = describe(kv.fmt, kv.paged, kv.block_size, heads=kv.heads)
        kv_size, num_layers, _, width = geometry.object_shape(1)  # every head's width, on any rank
        dtype = dtype_name(geometry.dtype)
        if kv.kv_dtype != dtype:  # fp8 caches of either encoding are uint8 tensors: the encoding splits the keys
            salt = f"{salt}|kv_cache_dtype={kv.kv_dtype}"
        return cls(model, salt, kv.fmt.name, dtype, kv_size, num_layers, width, codec)

    def namespace(self, chunk_size: int) -> CacheNamespace:
        """The key space (codec ``none`` where the server's applies: see `ServerBackend`, which leaves it out)."""
        shape = (self.kv_size, self.num_layers, chunk_size, self.width)
        layout = layout_name(EngineKVFormat[self.fmt], shape)
        return CacheNamespace(self.model, self.kv_dtype, layout, salt=self.salt, codec=self.codec or "none")

    def fields(self) -> dict[str, Any]:
        """The fields by name, plain values: `KeySpace(**fields)` is this key space again."""
        return asdict(self)


@dataclass(frozen=True)
class Hit:
    """Leading prompt tokens the cache holds (full chunks, then a stored tail of whole scheduler blocks: see
    `kvferry.cache.tails`); ``lock`` pins them until `free_lock`."""

    tokens: int
    lock: Any = None


class Lookups(Protocol):
    """What the scheduler half needs of a backend (or of a hybrid model's backends together)."""

    @property
    def chunk_size(self) -> int | None:
        """The cache's chunk size; None while a server was never reached."""
        ...

    def lookup(self, tokens: list[int]) -> Hit | None:
        """The cached prefix of ``tokens``, locked against eviction; None while chunks right after it are still
        coming up from a lower tier (ask again later). Never raises: a failure is a miss."""
        ...

    def free_lock(self, lock: Any) -> None: ...

    def close(self) -> None: ...


class Backend(Lookups, Protocol):
    def lookup(self, tokens: list[int], first_chunk: int = 0) -> Hit | None:
        """As `Lookups.lookup`; ``first_chunk``: the caller needs the chunks from this one on only (a backend may
        still ask for every chunk from token 0)."""
        ...

    def retrieve_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """Load the cached prefix of ``tokens``; resolves to how many leading tokens the blocks then hold (the
        skipped prefix included)."""
        ...

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """Store the KV of ``tokens``: full chunks, and the tokens after them (whole blocks) as a tail object."""
        ...

    def demote(self, tokens: list[int], chunks: range) -> None:
        """Chunks ``chunks`` of ``tokens``'s prefix go first when the cache evicts (see `CacheEngine.demote`)."""
        ...


class EmbeddedBackend:
    """A `CacheEngine` owned by this worker process.

    On a GPU each load and store is ordered, on the GPU, after what vLLM's stream had queued when the connector
    asked for it (an event recorded there: the forward pass that wrote the blocks a store reads, or the last
    reader of the blocks a load writes); the copy then runs on kvferry's streams from the engine's worker thread,
    whose own current stream is not vLLM's. Nothing waits on the CPU for the model."""

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

    def lookup(self, tokens: list[int], first_chunk: int = 0) -> Hit | None:
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

    def free_lock(self, lock: Any) -> None:
        self.engine.free_lookup_locks(lock)

    def demote(self, tokens: list[int], chunks: range) -> None:
        self.engine.demote(tokens, chunks, namespace=self.namespace)

    def retrieve_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        written = self.engine.retrieve_async(
            tokens,
            self.kv.paged,
            self.kv.kernel_block_ids(block_ids),
            self.kv.fmt,
            namespace=self.namespace,
            skip_prefix_tokens=skip_prefix_tokens,
            geometry=self.geometry,
            after=self._callers_stream(),
        )
        return _plus(written, skip_prefix_tokens)

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self.engine.store_async(
            tokens,
            self.kv.paged,
            self.kv.kernel_block_ids(block_ids),
            self.kv.fmt,
            namespace=self.namespace,
            skip_prefix_tokens=skip_prefix_tokens,
            geometry=self.geometry,
            after=self._callers_stream(),
            tail=True,
        )

    def _callers_stream(self) -> torch.cuda.Event | None:
        """An event at the end of what the calling thread's current stream (vLLM's) has queued; None on the CPU."""
        if not self._on_gpu:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.geometry.device))
        return event

    def close(self) -> None:
        self.engine.close()


class ServerBackend:
    """A ``kvferry server`` behind a `ServerLink` (misses while it is down). With ``kv`` the link registers the
    engine's KV cache (the worker); without, it only looks up (a scheduler in another process)."""

    def __init__(
        self, link: ServerLink, key_space: KeySpace, kv: EngineKV | None = None, *, block_size: int | None = None
    ) -> None:
        """``block_size``: the scheduler's, in which a tail hit counts (None: ``kv``'s)."""
        self.link = link
        self.key_space = key_space
        self._kv = kv
        self._block_size = block_size if block_size is not None or kv is None else kv.block_size * kv.split
        self._namespaces: dict[int, dict[str, Any]] = {}

    @property
    def chunk_size(self) -> int | None:
        return None if self.link.incompatible else self.link.chunk_size

    def lookup(self, tokens: list[int], first_chunk: int = 0) -> Hit | None:
        """Asks for every chunk from token 0 whatever ``first_chunk`` (the server's lookups have no start)."""
        try:
            generation = self.link.generation
            found = self.link.wait(
                lambda client, _: client.lookup_async(
                    tokens, namespace=self._namespace(), lock=True, block_size=self._block_size
                ),
                self.link.timeout_s,
            )
        except ServerDown:
            return Hit(0)
        except Exception as exc:
            log.warning("kvferry: lookup at %s failed (a miss): %s: %s", self.link.url, type(exc).__name__, exc)
            return Hit(0)
        lock = None if found.lock is None else (generation, found.lock)
        if found.pending:
            self.free_lock(lock)
            return None
        return Hit(found.tokens, lock)

    def free_lock(self, lock: Any) -> None:
        if lock is None:
            return
        generation, lock_id = lock
        if generation != self.link.generation:
            return  # taken from a server since gone (or restarted): it went with it
        try:
            self.link.call(lambda client, _: client.free_lookup_locks(lock_id))
        except Exception as exc:  # an expired lock, or the server went away: nothing to free any more
            log.debug("kvferry: freeing lookup lock %s: %s", lock_id, exc)

    def retrieve_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        ids = self._kernel_block_ids(block_ids)
        written = self.link.submit(
            lambda client, reg: client.retrieve_async(
                _registered(reg), tokens, ids, skip_prefix_tokens=skip_prefix_tokens
            )
        )
        return _plus(written, skip_prefix_tokens)

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        # Sent from vLLM's thread: the client records the STORE's ready event on vLLM's current stream, after the
        # forward pass that wrote the blocks, and the server's copy waits for it on the GPU.
        ids = self._kernel_block_ids(block_ids)
        return self.link.submit(
            lambda client, reg: client.store_async(
                _registered(reg), tokens, ids, skip_prefix_tokens=skip_prefix_tokens, tail=True
            )
        )

    def demote(self, tokens: list[int], chunks: range) -> None:
        """Nothing: the server's protocol has no demotion (its lookups need every chunk from token 0 anyway)."""

    def _kernel_block_ids(self, block_ids: list[int]) -> list[int] | Any:
        return block_ids if self._kv is None else self._kv.kernel_block_ids(block_ids)

    def close(self) -> None:
        self.link.close()

    def _namespace(self) -> dict[str, Any]:
        chunk_size = self.link.chunk_size
        assert chunk_size is not None  # the link is up, so the server told it
        if chunk_size not in self._namespaces:
            namespace = self.key_space.namespace(chunk_size)
            names = ("model", "kv_dtype", "layout", "world_size", "rank", "salt")
            fields = {name: getattr(namespace, name) for name in names}
            if self.key_space.codec is not None:  # else the server's cache.codec, as for the registration
                fields["codec"] = self.key_space.codec
            self._namespaces[chunk_size] = fields
        return self._namespaces[chunk_size]


def make_worker_backend(
    settings: ConnectorSettings,
    kv: EngineKV,
    *,
    model: str,
    block_size: int,
    name: str,
    on_chunk_size: Callable[[int], None] | None = None,
    group_tag: str = "",
    engine: CacheEngine | None = None,
    codec: str | None = None,
    split_tag: str = "",
) -> EmbeddedBackend | ServerBackend:
    """The backend of a worker that registered ``kv``: a cache engine in this process (embedded mode), or a session
    with the server that registers ``kv`` there (server mode; a chunk size that is not whole ``block_size``-token
    blocks of the scheduler refuses to start). What the connector makes in ``register_kv_caches``, without vLLM.

    A hybrid model's KV cache groups each make one, ``group_tag`` (`KVGroup.tag`) in their key space; in embedded
    mode they share one cache ``engine`` (the first group's backend's). ``codec``: the objects' (None: embedded
    mode's config, server mode the server's); one the KV cannot take refuses to start, saying why. A part of a
    layer split (`layer_parts`) gives its codec and the split's tag."""
    salt = settings.salt
    for tag in (group_tag, split_tag):  # the deployment's salt, then the tags of the KV's group and layer part
        salt = f"{salt}|{tag}" if tag else salt
    if codec is not None:  # refused here, before any server is asked, with the reason
        with_codec(describe(kv.fmt, kv.paged, kv.block_size, heads=kv.heads), codec)
    key_space = KeySpace.of(kv, model=model, salt=salt, codec=codec)

    def check_chunk_size(chunk_size: int) -> None:
        settings.check_chunk_size(chunk_size, block_size)
        if on_chunk_size is not None:
            on_chunk_size(chunk_size)

    if settings.mode == "server":
        deployment = {"model": key_space.model, "salt": key_space.salt}
        if codec is not None:
            deployment["codec"] = codec
        link = ServerLink(
            settings.server_url,
            timeout_s=settings.timeout_s,
            register=lambda client: client.register_kv_cache(
                kv.paged, kv.fmt, block_size=kv.block_size, namespace=deployment, heads=kv.heads
            ),
        )
        try:
            link.connect(check_chunk_size=check_chunk_size)  # a bad chunk size refuses to start
        except BaseException:
            link.close()
            raise
        return ServerBackend(link, key_space, kv)
    if engine is None:
        config = settings.kvferry_config()
        check_chunk_size(config.cache.chunk_size)
        if config.transfer != TransferConfig():  # the GPU data path is process-wide: changed only when asked to
            configure_gpu(**config.transfer.engine_settings())
        engine = CacheEngine(config, name=name)
    else:
        check_chunk_size(engine.chunk_size)
    namespace = engine.namespace_for(
        key_space.model,
        kv.fmt,
        kv.paged,
        world_size=1,
        rank=0,
        salt=key_space.salt,
        block_size=kv.block_size,
        codec=codec,
    )
    return EmbeddedBackend(engine, kv, namespace, key_space)


def _registered(registration: int | None) -> int:
    if registration is None:
        raise RuntimeError("this connector half registered no KV cache with the kvferry server")
    return registration


def _plus(future: Future[int], offset: int) -> Future[int]:
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
