"""Server-mode loads this process copies itself (the connector setting ``direct_loads``): the server locates a
prefix's objects in its shared pool (LOCATE, ``cache.shared_pool``) and this process copies them into the engine's
KV with its own transfer. On a GPU the gathers and DMAs then run in the engine's own context, not time-sliced with
a server process's, and no server thread is woken for the copy; the server keeps the index, eviction and tiers.

A located object's memory is held for this process by a read lease until its deadline: a copy that ended later
may have read bytes the server had reused, so it counts as a failed load (the engine recomputes those tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvferry.client.pool_map import MappedPool
from kvferry.client.records import LocateResult
from kvferry.connector.engine_kv import EngineKV
from kvferry.formats import describe
from kvferry.transfer import Direction, transfer
from kvferry.transfer.api import transfer_pool_at_async

log = logging.getLogger(__name__)


class LeaseExpired(RuntimeError):
    """A direct load's copy ended after its lease: the blocks may hold other bytes than the prefix's."""


class DirectLoads:
    """Copies located objects into one engine's KV (``kv``); thread-safe."""

    def __init__(self, kv: EngineKV, pool: MappedPool) -> None:
        self._kv = kv
        self._geom = describe(kv.fmt, kv.paged, kv.block_size)
        self._gpu = self._geom.device.type == "cuda"
        self._pool = pool
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="kvferry-direct-load")

    def start(
        self,
        located: LocateResult,
        block_ids: list[int],
        skip: int,
        chunk: int,
        release: Callable[[], None],
        *,
        wait_here: bool = False,
    ) -> Future[int]:
        """Enqueue the copy of ``located``'s objects into ``block_ids`` (the scheduler's), leaving the first
        ``skip`` tokens' blocks alone, ordered after this thread's current stream; the future gives the tokens the
        blocks then hold (``skip`` included). ``release`` ends the lease: called once the copy is over (done,
        failed or never started), after the future is settled, on this object's thread unless the copy failed to
        start. ``wait_here``: the copy is waited for on this
        thread (a foreground load: no hand-off to this object's thread and back); the future is then done."""
        future: Future[int] = Future()
        try:
            if located.tokens <= skip:
                future.set_result(skip)
            else:
                pool = self._pool.get(located.pool)
                geom, kv, bs = self._geom, self._kv, self._kv.block_size
                ids = kv.kernel_block_ids(block_ids)[: located.tokens // bs]
                if not self._gpu:
                    dtype = geom.object_dtype
                    objects = [pool.object_at(o, geom.object_shape(n), dtype) for o, n in located.objects]
                    transfer(kv.paged, objects, ids, Direction.H2D, kv.fmt, chunk, skip // bs, geometry=geom)
                    _settle(future, lambda: None, located)
                else:  # by address: no views to carve; the objects wholly skipped left out
                    first = skip // chunk
                    per_chunk = chunk // bs
                    located_from = located.objects[first:]
                    addresses = [pool.slab.data_ptr() + offset for offset, _ in located_from]
                    last = located_from[-1][1]
                    handle = transfer_pool_at_async(
                        geom,
                        addresses,
                        ids[first * per_chunk :],
                        Direction.H2D,
                        chunk,
                        skip // bs - first * per_chunk,
                        last_tokens=None if last == chunk else last,
                    )
                    if wait_here:
                        _settle(future, handle.wait, located)
                    else:
                        future = self._waiter.submit(_ended_in_time, handle.wait, located)
        except BaseException:
            release()
            raise
        if future.done():  # waited for here: the lease's FREE goes out on this object's thread, not the caller's
            self._waiter.submit(release)
        else:
            future.add_done_callback(lambda _: release())
        return future

    def map_ahead(self, locate: Callable[[], LocateResult]) -> None:
        """Map the server's pool on this object's thread now (``locate``: a LOCATE of nothing, whose answer names
        it), so that the first load does not wait for it: pinning a pool takes ~0.05 s a GiB (H100 host). Where that
        fails the first load finds out again and says so."""

        def map_it() -> None:
            try:
                self._pool.get(locate().pool)
            except Exception as exc:
                log.debug("kvferry: mapping the server's pool ahead of the first load: %s", exc)

        self._waiter.submit(map_it)

    def close(self) -> None:
        self._waiter.shutdown(wait=True)


def _settle(future: Future[int], wait: Callable[[], Any], located: LocateResult) -> None:
    try:
        future.set_result(_ended_in_time(wait, located))
    except Exception as exc:
        future.set_exception(exc)


def _ended_in_time(wait: Callable[[], Any], located: LocateResult) -> int:
    wait()
    ended = time.monotonic()  # the copy ended by now, so no later than this
    if ended >= located.deadline:
        raise LeaseExpired(f"a direct load ended {ended - located.deadline:.3f} s after its lease")
    return located.tokens
