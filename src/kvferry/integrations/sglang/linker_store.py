"""The unified-cache linker's work, without importing SGLang: pages of SGLang's device pool looked up, loaded and
offloaded through kvferry's cache, keyed as the HiCache backend keys them (`page_store`).

SGLang's scheduler thread calls in (`lookup`, `queue_load`, `start_loads`, `offload`); the copies run on two
threads of this class's own, one for loads and one for offloads, so that a slow offload never holds back the load
a forward pass waits for. Neither thread raises into SGLang: a load that does not land fails its batch in the layer
counter (SGLang then aborts the batch's loading requests: their slots hold what was there), and an offload that
does not land is a False result (SGLang keeps the pages out of its record of what the store holds).

A lookup's hits stay locked in the cache (against eviction) until their load has run, or until the request looks
up again, cancels, or is left out of the batch that started (it looks up anew when it is scheduled).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Any, Protocol

from kvferry.connector.backends import EmbeddedBackend
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.page_store import (
    PageBackend,
    PageKeySpace,
    check_page_size,
    leading_pages,
    page_tokens,
    pages_engine,
    pages_key_space,
    pages_namespace,
    pages_server_link,
)

log = logging.getLogger(__name__)


class ReadyEvent(Protocol):
    """A device event the copies wait for on the host (SGLang's stream events); none on CPU tensors."""

    def synchronize(self) -> None: ...


class LayerCounter(Protocol):
    """SGLang's ``LayerWiseLoadCounter``: what a forward pass waits on, layer by layer."""

    def update_producer(self) -> int: ...

    def complete(self, index: int, layer: int) -> None: ...

    def fail(self, index: int, error: BaseException) -> None: ...

    def reset(self) -> None: ...


@dataclass
class _Load:
    """One request's queued load: its pages' keys, the device pages they go to, the locks of its lookup."""

    keys: list[str]
    pages: list[int]
    locks: list[Any] = field(default_factory=list)


_STOP = None  # the threads' queues end with this


class LinkerStore:
    """Pages of one device pool (``backend``'s KV, one block per page) in kvferry's cache."""

    def __init__(
        self,
        backend: PageBackend,
        page_size: int,
        num_layers: int,
        counter: LayerCounter,
        closing: Callable[[], None],
        *,
        offload_owner: bool = True,
        name: str = "sglang",
    ) -> None:
        """``offload_owner``: False where another rank stores the same pages (an MLA model's TP ranks through one
        server): offloads then succeed at once without copying."""
        self.backend, self.page_size, self.num_layers, self.counter = backend, page_size, num_layers, counter
        self.offload_owner = offload_owner
        self._closing = closing
        self._looked_up: dict[str, list[Any]] = {}  # rid -> the locks of its last lookup (scheduler thread)
        self._queued: dict[str, _Load] = {}  # loads waiting for the next start (scheduler thread)
        self._loads: Queue[tuple[int, list[_Load], Sequence[ReadyEvent]] | None] = Queue()
        self._offloads: Queue[tuple[list[str], list[int], Sequence[ReadyEvent]] | None] = Queue()
        self._offloaded: Queue[bool] = Queue()
        self._threads = [
            threading.Thread(target=self._serve, args=(self._loads, self._load), name=f"kvferry-{name}-load"),
            threading.Thread(target=self._serve, args=(self._offloads, self._offload), name=f"kvferry-{name}-offload"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        self._closed = False

    # --- the scheduler's calls --------------------------------------------------------------------------------

    def lookup(self, rid: str, keys: Sequence[str]) -> list[int]:
        """The restorable prefix lengths of ``keys`` in pages, ``[1, ..., n]`` for the ``n`` leading pages the
        cache holds, locked for the load that may follow. A failed lookup is a miss."""
        self._free(self._looked_up.pop(rid, []))
        try:
            found, locks = leading_pages(self.backend, keys, self.page_size)
        except Exception as exc:  # the backends miss rather than raise; a miss all the same if one does
            log.warning("kvferry: a linker lookup failed (a miss): %s: %s", type(exc).__name__, exc)
            found, locks = 0, []
        if found:
            self._looked_up[rid] = locks
        else:
            self._free(locks)
        return list(range(1, found + 1))

    def queue_load(self, rid: str, keys: Sequence[str], pages: list[int]) -> bool:
        """Load ``keys`` into device ``pages`` at the next `start_loads`; False (refused) for a request that has a
        load queued already."""
        if rid in self._queued:
            log.warning("kvferry: a second linker load for request %s before the first started (refused)", rid)
            return False
        self._queued[rid] = _Load(list(keys), pages, self._looked_up.pop(rid, []))
        return True

    def cancel(self, rid: str) -> bool:
        """Drop ``rid``'s queued load; False where none is queued (it started, or never was)."""
        load = self._queued.pop(rid, None)
        if load is not None:
            self._free(load.locks)
        return load is not None

    def start_loads(self, ready: Sequence[ReadyEvent]) -> int:
        """Start the queued loads once ``ready`` has happened (what the engine's stream queued before: the last
        readers of the slots); the layer counter's index of the batch, or -1 where none was queued. Lookups that
        no load followed are unlocked: their requests were not scheduled and look up again when they are."""
        for locks in self._looked_up.values():
            self._free(locks)
        self._looked_up.clear()
        if not self._queued:
            return -1
        loads, self._queued = list(self._queued.values()), {}
        index = self.counter.update_producer()
        self._loads.put((index, loads, ready))
        return index

    def offload(self, keys: Sequence[str], pages: list[int], ready: Sequence[ReadyEvent]) -> None:
        """Store device ``pages`` under ``keys`` once ``ready`` has happened; its result comes in `pop_offload`."""
        if not self.offload_owner:
            self._offloaded.put(True)
            return
        self._offloads.put((list(keys), pages, ready))

    def completed_offloads(self) -> int:
        return self._offloaded.qsize()

    def pop_offload(self) -> bool:
        try:
            return self._offloaded.get_nowait()
        except Empty:
            return False

    def reset(self) -> None:
        """Wait for the loads and offloads under way; drop the queued ones, the results and every lock."""
        for rid in list(self._queued):
            self.cancel(rid)
        for locks in self._looked_up.values():
            self._free(locks)
        self._looked_up.clear()
        self._loads.join()
        self._offloads.join()
        while not self._offloaded.empty():
            self._offloaded.get_nowait()
        self.counter.reset()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._loads.put(_STOP)
        self._offloads.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._closing()

    # --- the threads ------------------------------------------------------------------------------------------

    @staticmethod
    def _serve(queue: Queue[Any], work: Callable[..., None]) -> None:
        while True:
            task = queue.get()
            try:
                if task is _STOP:
                    return
                work(*task)
            finally:
                queue.task_done()

    def _load(self, index: int, loads: list[_Load], ready: Sequence[ReadyEvent]) -> None:
        """A batch's loads: every page waited for (nothing writes the slots once the counter is told), then each
        layer completed, or the batch failed."""
        error: BaseException | None = None
        try:
            for event in ready:
                event.synchronize()
            keys = [key for load in loads for key in load.keys]
            pages = [page for load in loads for page in load.pages]
            tokens = [token for key in keys for token in page_tokens(key, self.page_size)]
            loaded = self.backend.retrieve_pages_async(tokens, pages).result() // self.page_size  # one copy for all
            if loaded != len(keys):
                error = RuntimeError(f"{len(keys) - loaded} of {len(keys)} pages were not in kvferry's cache any more")
        except BaseException as exc:
            error = exc
        finally:
            for load in loads:
                self._free(load.locks)
        if error is not None:
            log.warning("kvferry: a linker load failed (SGLang aborts it): %s: %s", type(error).__name__, error)
            self.counter.fail(index, error)
            return
        for layer in range(self.num_layers):
            self.counter.complete(index, layer)

    def _offload(self, keys: list[str], pages: list[int], ready: Sequence[ReadyEvent]) -> None:
        stored = True
        try:
            for event in ready:
                event.synchronize()
            tokens = [token for key in keys for token in page_tokens(key, self.page_size)]
            self.backend.store_pages_async(tokens, pages).result()  # one copy for all
        except Exception as exc:
            log.warning("kvferry: a linker offload failed: %s: %s", type(exc).__name__, exc)
            stored = False
        self._offloaded.put(stored)

    def _free(self, locks: list[Any]) -> None:
        for lock in locks:
            try:
                self.backend.free_lock(lock)
            except Exception as exc:  # an expired lock, or a server gone: nothing left to free
                log.debug("kvferry: freeing a linker lookup lock: %s", exc)


def open_linker_store(
    settings: ConnectorSettings,
    kv: EngineKV,
    keys: PageKeySpace,
    counter: LayerCounter,
    *,
    offload_owner: bool = True,
    name: str,
) -> LinkerStore:
    """The linker store of device KV ``kv`` in ``settings``' mode: a cache engine in this process whose chunk size
    is the page size, or the server at ``settings.server_url`` (whose ``--chunk-size`` must be the page size), with
    which ``kv`` is registered (CPU tensors move into shared memory in place, GPU ones are shared by CUDA IPC)."""
    page_size = kv.block_size
    user = "kvferry's SGLang linker"
    check_page_size(page_size, user)
    key_space = pages_key_space(kv, keys, settings)
    backend: PageBackend
    if settings.mode == "server":
        link = pages_server_link(settings, kv, keys, key_space, user)
        backend, closing = ServerBackend(link, key_space, kv), link.close
    else:
        engine = pages_engine(settings, page_size, name)
        try:
            backend, closing = (
                EmbeddedBackend(engine, kv, pages_namespace(engine, kv, keys, settings), key_space),
                engine.close,
            )
        except BaseException:
            engine.close()
            raise
    try:
        return LinkerStore(backend, page_size, len(kv.layers), counter, closing, offload_owner=offload_owner, name=name)
    except BaseException:
        closing()
        raise
