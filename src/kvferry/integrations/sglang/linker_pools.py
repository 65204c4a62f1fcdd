"""The linker's pools in kvferry's cache, without importing SGLang: each pool's objects behind a backend of their
own (in one cache engine in this process, or each registered with the server in a session of its own), and which
prefix lengths every pool can restore.

A prefix of ``n`` pages is restorable (SGLang's hit policies) when the ``kv`` pool holds its pages ``[0, n)`` and
each pool of trailing pages (``swa``: the sliding window's last pages; ``mamba``: the state at the prefix's end)
holds pages ``[n - trailing, n)``. SWA pages and states exist only where SGLang offloaded a node that ended there,
so the lengths are sparse: SGLang intersects them across its ranks and picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.connector.backends import EmbeddedBackend, Hit
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.device_pools import KV, LinkedPool
from kvferry.integrations.sglang.page_store import (
    PageBackend,
    PageKeySpace,
    check_page_size,
    page_tokens,
    pages_engine,
    pages_key_space,
    pages_namespace,
    pages_server_link,
)

log = logging.getLogger(__name__)

Lock = tuple[PageBackend, Any]  # a lookup's lock, and the backend that holds it


@dataclass(frozen=True)
class PoolPlan:
    """A pool as the linker links it: whose objects (``keys``: the model and this rank's shard of the pool), and
    whether this rank offloads it (False where another rank stores the same pages: an MLA model's)."""

    pool: LinkedPool
    keys: PageKeySpace
    owner: bool = True


@dataclass(frozen=True)
class PoolBackends:
    name: str
    backends: tuple[PageBackend, ...]  # one per kind of object of the pool
    indices_per_block: int
    owner: bool


@dataclass(frozen=True)
class PoolPages:
    """Pages of one pool to move: their keys (SGLang's page hashes) and the pool's blocks they go to or come from."""

    name: str
    keys: list[str]
    blocks: list[int]


def open_pool_backends(
    settings: ConnectorSettings, plans: Sequence[PoolPlan], page_size: int, name: str
) -> tuple[dict[str, PoolBackends], Callable[[], None]]:
    """Each planned pool's backends in ``settings``' mode, and what closes them all: embedded, one cache engine in
    this process whose chunk size is the page size; server mode, a session with the server at
    ``settings.server_url`` (whose ``--chunk-size`` must be the page size) for each kind of object, its KV
    registered there (CPU tensors move into shared memory in place, GPU ones are shared by CUDA IPC)."""
    user = "kvferry's SGLang linker"
    check_page_size(page_size, user)
    closers: list[Callable[[], None]] = []

    def close_all() -> None:
        for close in reversed(closers):
            close()

    pools: dict[str, PoolBackends] = {}
    try:
        engine = pages_engine(settings, page_size, name) if settings.mode != "server" else None
        if engine is not None:
            closers.append(engine.close)
        for plan in plans:
            backends: list[PageBackend] = []
            for objects in plan.pool.objects:
                kv, group, state = objects.kv, objects.group, objects.state
                key_space = pages_key_space(kv, plan.keys, settings, group, state=state)
                if engine is None:
                    link = pages_server_link(settings, kv, plan.keys, key_space, user)
                    closers.append(link.close)
                    backends.append(ServerBackend(link, key_space, kv))
                else:
                    namespace = pages_namespace(engine, kv, plan.keys, settings, group, state=state)
                    backends.append(EmbeddedBackend(engine, kv, namespace, key_space))
            pools[plan.pool.name] = PoolBackends(
                plan.pool.name, tuple(backends), plan.pool.indices_per_block, plan.owner
            )
    except BaseException:
        close_all()
        raise
    return pools, close_all


def restorable_prefixes(
    pools: dict[str, PoolBackends], keys: Sequence[str], trailing: dict[str, int], page_size: int
) -> tuple[list[int], list[Lock]]:
    """The prefix lengths of ``keys`` (in pages) that every pool can restore, each pool of ``trailing`` its last
    pages; and the locks of what the cache holds below the longest of them (the others freed)."""
    kv = pools[KV].backends[0]
    hits = kv.lookup_each([page_tokens(key, page_size) for key in keys])
    kv_pages = next((i for i, hit in enumerate(hits) if not _whole(hit, page_size)), len(hits))
    held: list[tuple[int, list[bool]]] = []
    side_hits: list[tuple[PageBackend, list[Hit | None]]] = []
    for name, pages in trailing.items():
        present = [True] * kv_pages
        for backend in pools[name].backends:
            found = backend.lookup_each([page_tokens(key, page_size) for key in keys[:kv_pages]]) if kv_pages else []
            side_hits.append((backend, found))
            present = [was and _whole(hit, page_size) for was, hit in zip(present, found, strict=True)]
        held.append((max(1, pages), present))
    restorable = [
        n for n in range(1, kv_pages + 1) if all(all(present[max(0, n - pages) : n]) for pages, present in held)
    ]
    top = restorable[-1] if restorable else 0
    locks: list[Lock] = []
    for backend, found in [(kv, hits), *side_hits]:
        for i, hit in enumerate(found):
            if hit is None or hit.lock is None:
                continue
            if i < top and _whole(hit, page_size):
                locks.append((backend, hit.lock))
            else:
                free_locks([(backend, hit.lock)])
    return restorable, locks


def free_locks(locks: Sequence[Lock]) -> None:
    for backend, lock in locks:
        try:
            backend.free_lock(lock)
        except Exception as exc:  # an expired lock, or a server gone: nothing left to free
            log.debug("kvferry: freeing a linker lookup lock: %s", exc)


def _whole(hit: Hit | None, page_size: int) -> bool:
    return hit is not None and hit.tokens >= page_size
