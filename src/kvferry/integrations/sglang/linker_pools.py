"""The linker's pools in kvferry's cache, without importing SGLang: each pool's objects behind a backend of their
own (in one cache engine in this process, or each registered with the server in a session of its own), and which
prefix lengths every pool can restore.

A prefix of ``n`` pages is restorable (SGLang's hit policies) when the ``kv`` pool holds its pages ``[0, n)`` and
each pool of trailing pages (``swa``: the sliding window's last pages; ``mamba``: the state at the prefix's end)
holds pages ``[n - trailing, n)``. SWA pages and states exist only where SGLang offloaded a node that ended there,
so the lengths are sparse: SGLang intersects them across its ranks and picks one.

With ``layer_groups`` (`LinkerSettings`), each kind of object is cut into groups of the forward's layers, each
group's pages objects of their own (the group's layers, a key space of their own: its ``split`` tag), so a load can
hand the forward each group as it lands; a page is then a hit where every group holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from kvferry.connector.backends import EmbeddedBackend, Hit
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.layer_parts import part_kv
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.device_pools import KV, LinkedPool, PoolObjects
from kvferry.integrations.sglang.page_store import (
    PageBackend,
    PageKeySpace,
    check_page_size,
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
    backends: tuple[PageBackend, ...]  # one per kind of object of the pool and group of layers
    groups: tuple[int, ...]  # each backend's group of layers (`layer_groups`)
    indices_per_block: int
    owner: bool


@dataclass(frozen=True)
class PoolPages:
    """Pages of one pool to move: their keys (SGLang's page hashes) and the pool's blocks they go to or come from."""

    name: str
    keys: list[str]
    blocks: list[int]


@dataclass(frozen=True)
class LookedUp:
    """A request's last lookup: the locks of its hits, its keys and their token rows (`page_tokens`), which a load
    of those pages takes as they are (on its path to the first DMA)."""

    locks: list[Lock]
    keys: list[str]
    rows: np.ndarray

    def rows_of(self, keys: list[str]) -> np.ndarray | None:
        """The token rows of ``keys`` where they are the lookup's first ones; else None."""
        n = len(keys)
        return self.rows[:n] if n <= len(self.keys) and keys == self.keys[:n] else None


NOT_LOOKED_UP = LookedUp([], [], np.zeros((0, 0), dtype="<u4"))


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """The forward's layers ``[0, num_layers)`` in ``groups`` runs as even as they go (fewer runs than layers)."""
    groups = max(1, min(groups, num_layers))
    return [range(a, b) for a, b in pairwise(g * num_layers // groups for g in range(groups + 1))]


def open_pool_backends(
    settings: ConnectorSettings,
    plans: Sequence[PoolPlan],
    page_size: int,
    name: str,
    groups: Sequence[range] = (),
) -> tuple[dict[str, PoolBackends], Callable[[], None]]:
    """Each planned pool's backends in ``settings``' mode, and what closes them all: embedded, one cache engine in
    this process whose chunk size is the page size; server mode, a session with the server at
    ``settings.server_url`` (whose ``--chunk-size`` must be the page size) for each kind of object, its KV
    registered there (CPU tensors move into shared memory in place, GPU ones are shared by CUDA IPC). With more
    than one of ``groups`` (`layer_groups`), a backend for each group's layers of each kind of object."""
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
            in_group: list[int] = []
            for objects in plan.pool.objects:
                group, state = objects.group, objects.state
                for index, kv, split in _layer_parts(objects, groups):
                    key_space = pages_key_space(kv, plan.keys, settings, group, state=state, split=split)
                    if engine is None:
                        link = pages_server_link(settings, kv, plan.keys, key_space, user)
                        closers.append(link.close)
                        backends.append(ServerBackend(link, key_space, kv))
                    else:
                        namespace = pages_namespace(engine, kv, key_space)
                        backends.append(EmbeddedBackend(engine, kv, namespace, key_space))
                    in_group.append(index)
            pools[plan.pool.name] = PoolBackends(
                plan.pool.name, tuple(backends), tuple(in_group), plan.pool.indices_per_block, plan.owner
            )
    except BaseException:
        close_all()
        raise
    return pools, close_all


def restorable_prefixes(
    pools: dict[str, PoolBackends], rows: np.ndarray, trailing: dict[str, int], page_size: int
) -> tuple[list[int], list[Lock]]:
    """The prefix lengths (in pages) of the pages whose token ``rows`` are given (`page_tokens`) that every pool can
    restore, each pool of ``trailing`` its last pages; and the locks of what the cache holds below the longest of
    them (the others freed)."""
    tokens = list(rows)
    kv_pages = len(tokens)
    found: list[tuple[PageBackend, list[Hit | None]]] = []
    for backend in pools[KV].backends:  # each group of layers looked up for what the groups before it hold
        hits = backend.lookup_each(tokens[:kv_pages]) if kv_pages else []
        found.append((backend, hits))
        kv_pages = next((i for i, hit in enumerate(hits) if not _whole(hit, page_size)), len(hits))
    held: list[tuple[int, list[bool]]] = []
    for name, pages in trailing.items():
        present = [True] * kv_pages
        for backend in pools[name].backends:
            hits = backend.lookup_each(tokens[:kv_pages]) if kv_pages else []
            found.append((backend, hits))
            present = [was and _whole(hit, page_size) for was, hit in zip(present, hits, strict=True)]
        held.append((max(1, pages), present))
    restorable = [
        n for n in range(1, kv_pages + 1) if all(all(present[max(0, n - pages) : n]) for pages, present in held)
    ]
    top = restorable[-1] if restorable else 0
    locks: list[Lock] = []
    unused: list[Lock] = []
    for backend, hits in found:
        for i, hit in enumerate(hits):
            if hit is not None and hit.lock is not None:
                (locks if i < top and _whole(hit, page_size) else unused).append((backend, hit.lock))
    free_locks(unused)
    return restorable, locks


def free_locks(locks: Sequence[Lock]) -> None:
    """Each backend's locks of ``locks``, freed together."""
    by_backend: dict[int, tuple[PageBackend, list[Any]]] = {}
    for backend, lock in locks:
        by_backend.setdefault(id(backend), (backend, []))[1].append(lock)
    for backend, held in by_backend.values():
        try:
            backend.free_locks(held)
        except Exception as exc:  # an expired lock, or a server gone: nothing left to free
            log.debug("kvferry: freeing linker lookup locks: %s", exc)


def _layer_parts(objects: PoolObjects, groups: Sequence[range]) -> Iterator[tuple[int, EngineKV, str | None]]:
    """``objects``' KV as the groups of layers cut it: (group, its layers' KV, the group's split tag), the whole
    KV untagged when there is one group."""
    if len(groups) <= 1:
        yield 0, objects.kv, None
        return
    for index, group in enumerate(groups):
        layers = [i for i, position in enumerate(objects.positions) if position in group]
        if layers:
            yield index, part_kv(objects.kv, layers), f"layers={group.start}-{group.stop - 1}"


def _whole(hit: Hit | None, page_size: int) -> bool:
    return hit is not None and hit.tokens >= page_size
