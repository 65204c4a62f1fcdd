"""Server-mode stores this process copies itself (the connector setting ``direct_stores``): the server reserves it
objects in its shared pool (RESERVE, ``cache.shared_pool``), kept here in stock; a store copies its chunks and tail
into them with this process's own transfer, ordered after the engine's stream, and once the copy is over sends
COMMIT, which makes them the cache's and reserves as many again. On a GPU the copy runs in the engine's own
context and no server thread is on its path; the server keeps the index, eviction and tiers.

The engine may reuse the blocks once the copy has ended (`kvferry.connector.copy_ends`), before the COMMIT is
answered: a lookup from elsewhere finds the chunks once it is. A store the stock cannot hold goes through STORE,
and the stock grows to twice the largest store seen (a store may start before the last one's COMMIT has brought
its objects back), up to ``MAX_STOCK`` objects: memory of the server's pool that holds no cached chunk meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvferry.cache.keys import TokenIds
from kvferry.cache.steps import Enqueued, Rest, Steps, started
from kvferry.client.pool_map import MappedPool, PoolMapping
from kvferry.client.records import Reserved
from kvferry.connector.engine_kv import EngineKV
from kvferry.formats import describe
from kvferry.transfer import Direction, transfer
from kvferry.transfer.api import transfer_pool_at_async

log = logging.getLogger(__name__)

MAX_STOCK = 32  # objects held in reserve at most (32 llama3-8b chunks of 256 tokens: 1 GiB of the server's pool)

# COMMIT(tokens, first chunk, objects, tail (offset, tokens) or None, refill): its answer
Commit = Callable[[TokenIds, int, list[int], tuple[int, int] | None, int], Future[Reserved]]


class DirectStores:
    """Copies one engine's stores (``kv``) into objects reserved for it; thread-safe. ``generation``: the server
    link's, whose session the objects are reserved in (a new session starts with none)."""

    def __init__(
        self, kv: EngineKV, pool: MappedPool, timeout_s: float, refused: Callable[[BaseException], bool]
    ) -> None:
        """``timeout_s``: how long a COMMIT's answer is waited for (the link's). ``refused``: whether a RESERVE's or
        COMMIT's error is a refusal the server would always give (a private pool, a tenant, coded objects): direct
        stores then turn off, said once (a COMMIT refused again and again would leave its objects reserved)."""
        self._kv = kv
        self._refused = refused
        self._timeout_s = timeout_s
        self._geom = describe(kv.fmt, kv.paged, kv.block_size)
        self._gpu = self._geom.device.type == "cuda"
        self._pool = pool
        self._lock = threading.Lock()
        self._stock: list[int] = []  # offsets of objects reserved in the link's current session
        self._mapping: PoolMapping | None = None
        self._generation = -1
        self._target = 0  # objects to hold: twice the largest store seen, up to MAX_STOCK
        self._asked = 0  # objects asked for and not answered yet
        self.off: str | None = None  # why stores no longer go direct (the server refused, or its pool is not here)
        self._rest = ThreadPoolExecutor(1, thread_name_prefix="kvferry-direct-store")

    @property
    def stocked(self) -> int:
        """Objects in stock now."""
        with self._lock:
            return len(self._stock)

    def start(
        self, tokens: TokenIds, block_ids: list[int], skip: int, chunk: int, generation: int, commit: Commit
    ) -> Future[int] | None:
        """The store of ``tokens``' chunks after ``skip`` (and its tail of whole blocks) copied from ``block_ids``
        (the scheduler's) into stock, ordered after this thread's current stream; its future gives the tokens
        stored once COMMIT has answered, and its copy's end is seen first (`copy_ends`). None where the stock of
        ``generation``'s session cannot hold it (the caller stores through STORE). ``chunk``: the server's chunk
        size."""
        bs = self._geom.bs
        n_full = len(tokens) // chunk
        first = min(skip // chunk, n_full)
        tail = (len(tokens) - n_full * chunk) // bs * bs
        if n_full * chunk + tail <= skip:
            tail = 0
        need = n_full - first + (tail > 0)
        if need == 0:
            return None
        with self._lock:
            if self.off or generation != self._generation or self._mapping is None or len(self._stock) < need:
                self._target = max(self._target, min(2 * need, MAX_STOCK))
                return None
            objects, self._stock = self._stock[:need], self._stock[need:]
            mapping = self._mapping
        try:
            steps = self._steps(tokens, block_ids, chunk, first, n_full, tail, objects, mapping, commit, generation)
            return started(steps, lambda rest, first_step: Rest.submit(self._rest, None, rest, first_step))
        except BaseException:
            self._put_back(generation, objects)
            raise

    def _steps(
        self,
        tokens: TokenIds,
        block_ids: list[int],
        chunk: int,
        first: int,
        n_full: int,
        tail: int,
        objects: list[int],
        mapping: PoolMapping,
        commit: Commit,
        generation: int,
    ) -> Steps[int]:
        """Copy (yielding once it is in flight, on a GPU), then COMMIT; the objects go back to stock where the copy
        fails or the steps are closed before it ended (their bytes are rewritten by the next store: nothing indexed
        them)."""
        bs, geom = self._geom.bs, self._geom
        per_chunk = chunk // bs
        ids = self._kv.kernel_block_ids(block_ids)[first * per_chunk : n_full * per_chunk + tail // bs]
        full = objects[: n_full - first]
        written = (n_full - first) * chunk + tail
        handle = None
        try:
            if self._gpu:  # by address (no views to carve), the tail's object a partial last one
                base = mapping.slab.data_ptr()
                addresses = [base + offset for offset in objects]
                last = tail or None
                handle = transfer_pool_at_async(geom, addresses, ids, Direction.D2H, chunk, 0, last_tokens=last)
                yield Enqueued(handle, written, final=True)
                handle.wait()
            else:
                shapes = [geom.object_shape(chunk)] * len(full) + ([geom.object_shape(tail)] if tail else [])
                views = [
                    mapping.object_at(o, shape, geom.object_dtype) for o, shape in zip(objects, shapes, strict=True)
                ]
                transfer(self._kv.paged, views, ids, Direction.D2H, self._kv.fmt, chunk, geometry=geom)
        except BaseException:  # closed early, or the copy failed: back to stock once no copy can still write them
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.wait()
            self._put_back(generation, objects)
            raise
        tail_object = (objects[-1], tail) if tail else None
        with self._lock:  # as many again as keep the stock at its target, counting what is asked for already
            refill = max(0, self._target - len(self._stock) - self._asked) if generation == self._generation else 0
            self._asked += refill
        try:
            answer = commit(tokens, first, full, tail_object, refill).result(timeout=self._timeout_s)
        except BaseException as exc:
            self._put_back(generation, [], refill)
            if self._refused(exc):
                self._turn_off(f"the server refused a COMMIT: {exc}")
            raise
        self._put_back(generation, answer.objects, refill)
        return answer.stored

    def refill(self, generation: int, reserve: Callable[[int], Future[Reserved]]) -> None:
        """Ask for objects (``reserve(count)``: a RESERVE of ``generation``'s session) where the stock is short of
        its target, without waiting; the first answer maps the pool."""
        with self._lock:
            if self.off:
                return
            if generation != self._generation:  # a new session: what was reserved went with the old one
                self._generation, self._stock, self._asked, self._mapping = generation, [], 0, None
            count = self._target - len(self._stock) - self._asked
            if count <= 0:
                return
            self._asked += count
        asked = reserve(count)
        # answered on this object's thread, not the client's reader: the first answer maps (and pins) the pool
        asked.add_done_callback(lambda done: self._answer_later(generation, count, done))

    def _answer_later(self, generation: int, count: int, done: Future[Reserved]) -> None:
        with contextlib.suppress(RuntimeError):  # closed: the objects go with the session
            self._rest.submit(self._answered, generation, count, done)

    def _answered(self, generation: int, count: int, done: Future[Reserved]) -> None:
        exc = done.exception()
        mapping = None
        if exc is None:
            reserved = done.result()
            try:
                mapping = self._pool.get(reserved.pool) if reserved.pool is not None else None
            except OSError as error:
                self._turn_off(f"its pool cannot be mapped here: {error}")
        elif self._refused(exc):
            self._turn_off(f"the server does not reserve objects: {exc}")
        else:
            log.debug("kvferry: reserving objects for direct stores: %s", exc)
        with self._lock:
            if generation != self._generation:
                return
            self._asked -= count
            if mapping is not None:
                self._mapping = mapping
                self._stock += reserved.objects

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if self.off:
                return
            self.off = why
        log.warning("kvferry: stores go through STORE, not direct: %s", why)

    def _put_back(self, generation: int, objects: list[int], asked: int = 0) -> None:
        """``objects`` into stock (and ``asked`` objects asked for answered), unless the link has a new session."""
        with self._lock:
            if generation == self._generation:
                self._stock += objects
                self._asked -= asked

    def close(self) -> None:
        self._rest.shutdown(wait=True)
