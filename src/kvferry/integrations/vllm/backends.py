"""Where the connector's KV goes: a cache engine in this process, or a ``kvferry server`` through the client.

Both give the scheduler half a ``lookup`` and the worker half ``retrieve`` / ``store_async`` on the engine's
registered KV. The worker half creates the backend when vLLM registers its KV cache. When vLLM runs the scheduler
half in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or a GPU engine with one worker) it finds the
backend in this process's registry; otherwise (vLLM's CPU backend runs its worker in a process of its own) the
scheduler half looks up through its own `ServerLookup`, in the key space the worker reported at start-up.

A backend never raises into vLLM on the lookup path: a failed lookup is a miss (logged).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Protocol

import kvferry
from kvferry.cache import CacheEngine, CacheNamespace
from kvferry.cache.request import dtype_name, layout_name
from kvferry.client import KvferryClient
from kvferry.formats import describe
from kvferry.integrations.vllm.kv_layout import EngineKV

log = logging.getLogger(__name__)


class Backend(Protocol):
    chunk_size: int

    def namespace_fields(self) -> dict[str, str | int]:
        """The cache key space of this engine's KV, as plain fields (what a lookup from elsewhere names)."""
        ...

    def lookup(self, tokens: list[int]) -> int | None: ...

    def retrieve(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> int: ...

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]: ...

    def close(self) -> None: ...


class EmbeddedBackend:
    """A `CacheEngine` owned by this worker process."""

    def __init__(self, engine: CacheEngine, kv: EngineKV, namespace: CacheNamespace) -> None:
        self.engine = engine
        self.kv = kv
        self.namespace = namespace
        self.chunk_size = engine.chunk_size
        # Validated once here: every load and store then skips re-describing vLLM's tensors.
        self.geometry = describe(kv.fmt, kv.layers, kv.block_size)

    def namespace_fields(self) -> dict[str, str | int]:
        return _fields(self.namespace)

    def lookup(self, tokens: list[int]) -> int | None:
        """The pool's prefix hit; None while chunks right after it are still being promoted from a tier."""
        try:
            status = self.engine.lookup_status(tokens, namespace=self.namespace)
        except Exception:
            log.exception("kvferry: lookup failed (counted as a miss)")
            return 0
        return None if status.pending_tokens else status.hit_tokens

    def retrieve(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> int:
        written = self.engine.retrieve(
            tokens,
            self.kv.layers,
            block_ids,
            self.kv.fmt,
            namespace=self.namespace,
            skip_prefix_tokens=skip_prefix_tokens,
            geometry=self.geometry,
        )
        return skip_prefix_tokens + written

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self.engine.store_async(
            tokens,
            self.kv.layers,
            block_ids,
            self.kv.fmt,
            namespace=self.namespace,
            skip_prefix_tokens=skip_prefix_tokens,
            geometry=self.geometry,
        )

    def close(self) -> None:
        self.engine.close()


class ServerBackend:
    """A session with a ``kvferry server`` holding this worker's KV registration."""

    def __init__(self, client: KvferryClient, kv: EngineKV, *, model: str, salt: str = "") -> None:
        self.client = client
        self.kv = kv
        self.chunk_size = client.chunk_size
        # Moves the engine's CPU KV into shared memory in place (every view, vLLM's included, follows).
        self.registration = client.register_kv_cache(
            kv.layers, kv.fmt, block_size=kv.block_size, namespace={"model": model, "salt": salt}
        )
        # The key space the server derives from the registration, so a process without the KV can look up in it.
        shape = kvferry.object_shape(kv.fmt, kv.layers, self.chunk_size, kv.block_size)
        self.namespace = CacheNamespace(model, dtype_name(kv.layers[0].dtype), layout_name(kv.fmt, shape), salt=salt)

    def namespace_fields(self) -> dict[str, str | int]:
        return _fields(self.namespace)

    def lookup(self, tokens: list[int]) -> int | None:
        try:
            return self.client.lookup(tokens, registration=self.registration).tokens
        except Exception:
            log.exception("kvferry: lookup at %s failed (counted as a miss)", self.client.endpoint)
            return 0

    def retrieve(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> int:
        written = self.client.retrieve(self.registration, tokens, block_ids, skip_prefix_tokens=skip_prefix_tokens)
        return skip_prefix_tokens + written

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self.client.store_async(self.registration, tokens, block_ids, skip_prefix_tokens=skip_prefix_tokens)

    def close(self) -> None:
        self.client.close()


class ServerLookup:
    """Lookups at a ``kvferry server`` in a key space named explicitly (for a scheduler without the KV)."""

    def __init__(self, client: KvferryClient, namespace: dict[str, str | int]) -> None:
        self.client = client
        self.namespace = namespace
        self.chunk_size = client.chunk_size

    def lookup(self, tokens: list[int]) -> int | None:
        try:
            return self.client.lookup(tokens, namespace=self.namespace).tokens
        except Exception:
            log.exception("kvferry: lookup at %s failed (counted as a miss)", self.client.endpoint)
            return 0

    def close(self) -> None:
        self.client.close()


def _fields(namespace: CacheNamespace) -> dict[str, str | int]:
    names = ("model", "kv_dtype", "layout", "world_size", "rank", "salt")
    return {name: getattr(namespace, name) for name in names}


_registry: dict[str, Backend] = {}
_registry_lock = threading.Lock()


def publish(engine_id: str, backend: Backend) -> None:
    """Make ``backend`` the one of vLLM engine ``engine_id`` in this process."""
    with _registry_lock:
        if engine_id in _registry:
            raise RuntimeError(f"vLLM engine {engine_id!r} already registered its KV cache with kvferry")
        _registry[engine_id] = backend


def find(engine_id: str) -> Backend | None:
    with _registry_lock:
        return _registry.get(engine_id)


def withdraw(engine_id: str) -> Backend | None:
    with _registry_lock:
        return _registry.pop(engine_id, None)
