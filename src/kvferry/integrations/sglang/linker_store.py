"""The unified-cache linker's work, without importing SGLang: pages of SGLang's device pools looked up, loaded and
offloaded through kvferry's cache, keyed as the HiCache backend keys them (`page_store`), each pool's objects
behind backends of their own (`linker_pools`).

SGLang's scheduler thread calls in (`lookup`, `queue_load`, `start_loads`, `offload`). `start_loads` enqueues a
batch's loads itself, after what the scheduler's current stream has queued (the slots' last readers): on the GPU no
host wait and no thread hand-off comes before the first DMA. Where the copies run on this process's GPU, the forward's
stream waits for their end on the GPU (`load_counter`); whichever thread sees a move land (the cache engine's worker
that waited for its copy; through a server, the forward's thread about to wait, at the move's done flag) completes the
layer counter there, and that tells SGLang after the forward whether the load landed (`_Batch`); a thread of this
class's own then frees the load's locks (a server call). An offload starts on the scheduler's thread too, its copies
ordered after SGLang's streams on the GPU (no host wait and no thread hand-off: ~0.2-0.3 ms of a 64-page offload
on the H100 host), and its outcome is kept in the order of the offloads (SGLang pairs the n-th outcome it takes with
its n-th offload; `offload_outcomes`). A load's groups of layers (`linker_pools`) are all under way at once, the first
group started first, and each is completed in the layer counter once it and every group before it landed. Nothing
raises into SGLang: a load that does not land fails its batch in the layer counter (SGLang then aborts the batch's
loading requests: their slots hold what was there), and an offload that does not land is a False result (SGLang keeps
the pages out of its record of what the store holds).

A lookup's hits stay locked in the cache (against eviction) until their load has run, or until the request looks
up again, cancels, or is left out of the batch that started (it looks up anew when it is scheduled).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from queue import Queue
from typing import Any, TypeVar

import numpy as np

from kvferry.cache.keys import TokenIds
from kvferry.connector.copy_ends import copied_probe, copy_end, wait_here
from kvferry.connector.settings import ConnectorSettings
from kvferry.futures import failed_future, when_all
from kvferry.integrations.sglang.linker_pools import (
    NOT_LOOKED_UP,
    Lock,
    LookedUp,
    PoolBackends,
    PoolPages,
    PoolPlan,
    free_locks,
    layer_groups,
    open_pool_backends,
    restorable_prefixes,
)
from kvferry.integrations.sglang.load_counter import CopyEnd, LoadCounter
from kvferry.integrations.sglang.offload_outcomes import Move, OffloadOutcomes, stored
from kvferry.integrations.sglang.page_store import PageTokens, page_tokens
from kvferry.transfer import ordered_after
from kvferry.transfer.stream_marks import StreamMarks

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Load:
    """One request's queued load: each pool's pages, and its lookup."""

    pages: list[PoolPages]
    looked_up: LookedUp = NOT_LOOKED_UP


_STOP = None  # the load thread's queue ends with this


class LinkerStore:
    """SGLang's device pools (``pools``, by SGLang's pool name; ``kv`` among them) in kvferry's cache; a load's
    layers completed in the counter by ``groups`` (runs of the forward's layers, in order; the pools' backends
    belong to one each)."""

    def __init__(
        self,
        pools: dict[str, PoolBackends],
        page_size: int,
        groups: Sequence[range],
        counter: LoadCounter,
        closing: Callable[[], None],
        *,
        name: str = "sglang",
        marks: StreamMarks | None = None,
    ) -> None:
        self.pools, self.page_size, self.layer_groups, self.counter = pools, page_size, list(groups), counter
        self._closing = closing
        self._looked_up: dict[str, LookedUp] = {}  # rid -> its last lookup
        self._queued: dict[str, _Load] = {}  # loads waiting for the next start (scheduler thread)
        self._batches = _Batches()  # the loads under way
        self._ended: Queue[tuple[_Batch] | None] = Queue()  # loads whose moves all ended
        self._offloads = OffloadOutcomes()
        self._marks = marks  # of SGLang's streams that an offload's copies wait for (on a GPU)
        self._thread = threading.Thread(target=self._serve, name=f"kvferry-{name}-load", daemon=True)
        self._thread.start()
        self._closed = False

    # --- the scheduler's calls --------------------------------------------------------------------------------

    def lookup(self, rid: str, keys: Sequence[str], trailing: dict[str, int] | None = None) -> list[int]:
        """The prefix lengths of ``keys`` in pages that every pool can restore (the ``kv`` pool its leading
        pages, each pool of ``trailing`` its last pages: see `linker_pools`), what they need locked for the load
        that may follow. A failed lookup is a miss."""
        free_locks(self._looked_up.pop(rid, NOT_LOOKED_UP).locks)
        try:
            rows = page_tokens(keys, self.page_size)
            restorable, locks = restorable_prefixes(self.pools, rows, trailing or {}, self.page_size)
        except Exception as exc:  # the backends miss rather than raise; a miss all the same if one does
            log.warning("kvferry: a linker lookup failed (a miss): %s: %s", type(exc).__name__, exc)
            return []
        if restorable:
            rows.flags.writeable = False  # shared with the load that follows
            self._looked_up[rid] = LookedUp(locks, list(keys), rows)
        else:
            free_locks(locks)
        return restorable

    def queue_load(self, rid: str, pages: list[PoolPages]) -> bool:
        """Load each pool's ``pages`` at the next `start_loads`; False (refused) for a request that has a load
        queued already."""
        if rid in self._queued:
            log.warning("kvferry: a second linker load for request %s before the first started (refused)", rid)
            return False
        self._queued[rid] = _Load(pages, self._looked_up.pop(rid, NOT_LOOKED_UP))
        return True

    def cancel(self, rid: str) -> bool:
        """Drop ``rid``'s queued load; False where none is queued (it started, or never was)."""
        load = self._queued.pop(rid, None)
        if load is not None:
            free_locks(load.looked_up.locks)
        return load is not None

    def start_loads(self) -> int:
        """Start the queued loads, after what the calling thread's current stream has queued (the slots' last
        readers); the layer counter's index of the batch, or -1 where none was queued. Lookups that no load
        followed are unlocked: their requests were not scheduled and look up again when they are."""
        for looked_up in self._looked_up.values():
            free_locks(looked_up.locks)
        self._looked_up.clear()
        if not self._queued:
            return -1
        loads, self._queued = list(self._queued.values()), {}
        error: BaseException | None = None
        try:
            parts = [(part, load.looked_up) for load in loads for part in load.pages]
            moves = self._start(parts, "retrieve_pages_async")
        except Exception as exc:  # before any move started (a move's own failure is its future's)
            moves, error = [[] for _ in self.layer_groups], exc
        # The batch enters the counter once its copies are under way, off the path to their first DMA; nothing
        # completes it before `follow` (its moves' callbacks are added there).
        index = self.counter.update_producer()
        batch = _Batch(self, index, [lock for load in loads for lock in load.looked_up.locks])
        ends: list[list[CopyEnd] | None] = [_of_each(group, copy_end) for group in moves]
        if any(ends):  # a copy on this process's GPU: the forward's stream waits for it there
            self.counter.on_device(index, self.layer_groups, ends)
        batch.follow(moves, error)
        self.counter.on_host(index, batch.wait_here)
        return index

    def offload(self, pages: list[PoolPages], after: Sequence[int]) -> None:
        """Store each pool's ``pages`` (of the pools this rank owns: another's are stored by the rank that does)
        once the work queued so far on the streams ``after`` has run (raw CUDA streams of the pools' GPU, SGLang's
        that write the pages; none on the CPU), started here; its result comes in `pop_offload`, after those of
        the offloads before it."""
        owned = [part for part in pages if self.pools[part.name].owner]
        try:
            moves = [move for group in self._start_after(after, owned) for move in group] if owned else []
        except Exception as exc:  # before any move started (a move's own failure is its future's)
            moves = [(0, failed_future(exc))]
        outcome = when_all([future for _, future in moves], lambda: stored(moves))
        self._offloads.add(outcome, _of_each(moves, copied_probe))

    def completed_offloads(self) -> int:
        """How many offloads have ended, counted from the oldest not taken (one still running ends the count)."""
        return self._offloads.ended()

    def pop_offload(self) -> bool:
        """The oldest offload's outcome (True: stored), taken; False where it has not ended."""
        return self._offloads.take()

    def reset(self) -> None:
        """Wait for the loads and offloads under way; drop the queued ones, the results and every lock."""
        for rid in list(self._queued):
            self.cancel(rid)
        for looked_up in self._looked_up.values():
            free_locks(looked_up.locks)
        self._looked_up.clear()
        self._batches.wait_all()
        self._offloads.clear()
        self.counter.reset()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._ended.put(_STOP)
        self._thread.join()
        if self._marks is not None:
            self._marks.close()
        self._closing()

    # --- the threads ------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        """End the loads whose moves all ended (`_Batch.end`), in turn."""
        while True:
            task = self._ended.get()
            if task is _STOP:
                return
            task[0].end()

    def _start_after(self, after: Sequence[int], parts: list[PoolPages]) -> list[list[Move]]:
        """`_start` of stores whose copies wait on the GPU for what the streams ``after`` queued so far: for one mark
        of them (`StreamMarks.record_on`) as the start's `ordered_after` event (its stores' copies and rests wait
        for it; through a server their ready events do). No stream of SGLang's changes, none is made current."""
        stores = [(part, NOT_LOOKED_UP) for part in parts]
        if not after or self._marks is None:
            return self._start(stores, "store_pages_async")
        mark = self._marks.record_on(after)
        try:
            with ordered_after(mark.cuda_event):
                moves = self._start(stores, "store_pages_async")
        except BaseException:
            mark.release()
            raise
        when_all([future for group in moves for _, future in group], mark.release)  # each wait on it enqueued
        return moves

    def _start(self, parts: list[tuple[PoolPages, LookedUp]], how: str) -> list[list[Move]]:
        """Each pool's pages of ``parts`` (each with its request's lookup, whose token rows it reuses) moved by each
        of its backends' ``how``, one copy per backend, all of them under way together; the moves by group of
        layers, the first group's started first."""
        by_pool: dict[str, tuple[list[str], list[int], list[np.ndarray | None]]] = {}
        for part, looked_up in parts:
            keys, blocks, rows = by_pool.setdefault(part.name, ([], [], []))
            keys += part.keys
            blocks += part.blocks
            rows.append(looked_up.rows_of(part.keys))
        tokens = {name: self._tokens(keys, rows) for name, (keys, _, rows) in by_pool.items()}
        moves: list[list[Move]] = [[] for _ in self.layer_groups]
        for index, group in enumerate(moves):
            for name, (keys, blocks, _) in by_pool.items():
                pool, pages = self.pools[name], len(keys)
                for backend, in_group in zip(pool.backends, pool.groups, strict=True):
                    if in_group == index:
                        group.append((pages, _call(getattr(backend, how), tokens[name], blocks)))
        return moves

    def _tokens(self, keys: list[str], rows: list[np.ndarray | None]) -> TokenIds:
        """The tokens a pool's ``keys`` are stored under: the rows their lookups made where every part has them (a
        part's own, as they are, where it is the only one), else made when the cache first reads them
        (`PageTokens`: a store's copy is enqueued first)."""
        known = [part for part in rows if part is not None]
        if len(known) < len(rows):
            return PageTokens(keys, self.page_size)
        return (known[0] if len(known) == 1 else np.concatenate(known)).reshape(-1)


class _Batch:
    """A started batch's moves, followed by their done callbacks: each group of layers completed in the counter
    once it and every group before it landed whole (in order, under the lock), the batch failed once every move has
    ended if one did not land (nothing writes the slots once the counter is told; the groups before the first that
    failed are completed all the same), its lookup locks freed then."""

    def __init__(self, store: LinkerStore, index: int, locks: list[Lock]) -> None:
        self._store, self._index, self._locks = store, index, locks
        self._lock = threading.Lock()
        self._by_group: list[list[Move]] = []  # the moves
        self._left: list[int] = []  # moves not landed, by group
        self._next = 0  # the next group to complete
        self._moves = 0  # moves not ended
        self._error: BaseException | None = None
        self._failed = 0  # the first group that failed (with `_error`)

    def follow(self, moves: list[list[Move]], error: BaseException | None) -> None:
        """Follow ``moves`` (by group of layers), or fail the batch with ``error`` (raised before any started)."""
        self._by_group = moves
        self._left = [len(group) for group in moves]
        self._moves = sum(self._left) + 1  # + this call's own hold: no ending before every callback is added
        self._error = error
        self._store._batches.add(self)
        for group, group_moves in enumerate(moves):
            for pages, future in group_moves:
                future.add_done_callback(functools.partial(self._landed, group, pages))
        self._ended(None, None)

    def wait_here(self, layer: int) -> None:
        """Wait on this thread (the forward's, about to wait for ``layer`` on the CPU) for the moves of the groups up
        to the one of ``layer`` that went through a server (`copy_ends.wait_here`): their ends complete the layers
        here."""
        for group, moves in zip(self._store.layer_groups, self._by_group, strict=True):
            for _, future in moves:
                wait_here(future)
            if layer in group:
                return

    def _landed(self, group: int, pages: int, done: Future[int]) -> None:
        error = done.exception()
        if error is None:
            missing = pages - done.result() // self._store.page_size
            if missing:
                error = RuntimeError(f"{missing} pages were not in kvferry's cache any more")
        self._ended(group, error)

    def _ended(self, group: int | None, error: BaseException | None) -> None:
        """A move of ``group`` ended (None: `follow`'s own hold on the batch), with ``error`` if it did not land."""
        counter, groups = self._store.counter, self._store.layer_groups
        with self._lock:
            if group is not None:
                self._left[group] -= 1
                if error is not None and (self._error is None or group < self._failed):
                    self._error, self._failed = error, group
            while self._next < len(self._left) and not self._left[self._next]:
                if self._error is not None and self._next >= self._failed:
                    break
                counter.complete_layers(self._index, groups[self._next])
                self._next += 1
            self._moves -= 1
            if self._moves:
                return
        self._store._ended.put((self,))  # not here: a server's answers are read on the thread that may run this

    def end(self) -> None:
        """Every move ended: the lookup locks freed, the batch failed if a move did not land."""
        free_locks(self._locks)
        if self._error is not None:
            err = self._error
            log.warning("kvferry: a linker load failed (SGLang aborts it): %s: %s", type(err).__name__, err)
            self._store.counter.fail(self._index, err)
        self._store._batches.discard(self)


class _Batches:
    """The batches under way, for `LinkerStore.reset` to wait for."""

    def __init__(self) -> None:
        self._under_way: set[_Batch] = set()
        self._changed = threading.Condition()

    def add(self, batch: _Batch) -> None:
        with self._changed:
            self._under_way.add(batch)

    def discard(self, batch: _Batch) -> None:
        with self._changed:
            self._under_way.discard(batch)
            self._changed.notify_all()

    def wait_all(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self._under_way)


def _of_each(moves: list[Move], of: Callable[[Future[int]], T | None]) -> list[T] | None:
    """``of`` each move's future (`copy_end`: its copy's end on this process's GPU; `copied_probe`: whether its copy
    has ended), those that have none left out where they have ended (a miss, a failure before the copy); None
    where one has none and is still running (it ends when its future resolves: through a server, on the CPU)."""
    found: list[T] = []
    for _, future in moves:
        one = of(future)
        if one is not None:
            found.append(one)
        elif not future.done():
            return None
    return found


def _call(move: Callable[[Any, list[int]], Future[int]], tokens: Any, blocks: list[int]) -> Future[int]:
    """``move(tokens, blocks)``; what it raises as its future's failure (the moves started before it go on)."""
    try:
        return move(tokens, blocks)
    except Exception as exc:
        return failed_future(exc)


def open_linker_store(
    settings: ConnectorSettings, plans: Sequence[PoolPlan], page_size: int, num_layers: int, counter: LoadCounter,
    *, name: str, groups: int = 1,
) -> LinkerStore:  # fmt: skip
    """The linker store of the planned pools in ``settings``' mode (`linker_pools.open_pool_backends`), its loads
    landing in ``groups`` groups of layers."""
    runs = layer_groups(num_layers, groups)
    pools, closing = open_pool_backends(settings, plans, page_size, name, runs)
    try:
        device = plans[0].pool.objects[0].kv.layers[0].device
        marks = StreamMarks(device) if device.type == "cuda" else None
        return LinkerStore(pools, page_size, runs, counter, closing, name=name, marks=marks)
    except BaseException:
        closing()
        raise
