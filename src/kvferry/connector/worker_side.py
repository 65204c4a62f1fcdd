"""The worker half of the connector: carries out each step's `StepPlan` against the engine's KV cache.

Loads come in two kinds. A background load (vLLM's async-load path: the request waits in
WAITING_FOR_REMOTE_KVS) starts after the step's forward pass and runs while later steps decode the other
requests; it is reported through `finished_loading` once done. A foreground load completes before the forward
pass of the step that schedules its request. Either way a load that comes back short (a tier error, the server
gone) is reported block by block, so vLLM recomputes exactly those tokens instead of reading stale KV, and every
load, short or not, is reported in `take_load_report` so the scheduler half frees its lock.

Stores start after the forward pass and run in the background; a request's blocks stay with it until its stores
are done, which this side reports through `finished_sending`.

A hybrid model's plan names each load's and store's KV cache group (`LoadSpec.group`): each group has a backend
of its own, a request's loads are reported once all its groups' ran, and its counters count one group's tokens
(the one given as ``counted_group``). A windowed group's stores end before the next step's forward pass
(`settle_windowed_stores`): vLLM frees such a group's blocks as its window slides, while the request runs. The
windowed chunks a request's stores supersede are demoted once all its stores have ended
(`WindowedBackend.superseded`).

While any of them runs, Python's GIL switch interval is cut to `HANDOFF_S` (`GilHandoff`). A background load
or store hands the GIL back and forth many times (each copy call, each reply read off the server's socket), and
vLLM's engine loop runs Python without a pause while a request waits for its load: at the default 5 ms interval a
hit's 22 MiB load on vLLM's CPU backend took 182 ms instead of 9.4 ms in the foreground (12.8 ms at 0.1 ms;
`kvferry bench vllm-ttft`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all

from kvferry.cache.keys import TokenIds
from kvferry.connector.backends import Transfers
from kvferry.connector.copy_ends import copied, copied_probe
from kvferry.connector.counters import WorkerCounters
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerDown
from kvferry.connector.window_groups import WindowedBackend
from kvferry.futures import failed_future

log = logging.getLogger(__name__)


HANDOFF_S = 1e-4  # the GIL switch interval while kvferry's work runs in the background


class GilHandoff:
    """Holds Python's switch interval at ``HANDOFF_S`` or less while a watched future runs, and gives back the one
    it found once none does (vLLM's own threads then run as they did). One per process (`_HANDOFF`): the
    interval is the process's, and two holders would restore each other's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._saved = 0.0

    def watch(self, future: Future[int]) -> Future[int]:
        with self._lock:
            if not self._running:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, HANDOFF_S))
            self._running += 1
        future.add_done_callback(self._ended)
        return future

    def _ended(self, _: Future[int]) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                sys.setswitchinterval(self._saved)


_HANDOFF = GilHandoff()


class WorkerSide:
    def __init__(
        self,
        backend: Transfers | Sequence[Transfers],
        *,
        block_size: int | Sequence[int],
        after_load: Callable[[list[int]], None] | None = None,
        counted_group: int = 0,
        windowed_groups: Iterable[int] = (),
    ) -> None:
        """``backend``: one, or one per KV cache group with its block size in ``block_size``. ``after_load(block_ids)``
        runs after each load with the blocks written (a debugging/testing hook)."""
        self._backends = list(backend) if isinstance(backend, Sequence) else [backend]
        self._block_sizes = list(block_size) if isinstance(block_size, Sequence) else [block_size]
        self.block_size = self._block_sizes[0]
        self._after_load = after_load
        self._counted_group = counted_group
        self._windowed_groups = frozenset(windowed_groups)
        self._windowed_stores: list[Future[int]] = []  # since the last settle_windowed_stores
        self._loading: dict[str, list[tuple[LoadSpec, Future[int], _Timer]]] = {}  # background loads in flight
        # req_id -> its unfinished stores (and whether their group is the counted one)
        self._inflight: dict[str, list[tuple[Future[int], _Timer, bool]]] = {}
        # req_id -> group -> the chunks its stores superseded so far, and its longest tokens (naming them all)
        self._superseded: dict[str, dict[int, tuple[TokenIds, range]]] = {}
        self._saving: set[str] = set()  # requests vLLM keeps blocks for until their stores are reported done
        self._finished: set[str] = set()  # those of them that vLLM reported finished
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # background loads of a model of several groups that came back short
        self._loads_done: set[str] = set()
        self._loads_failed: set[str] = set()
        self.counters = WorkerCounters()

    def start_loads(self, plan: StepPlan) -> None:
        """Start the plan's background loads; run its foreground loads to the end."""
        for spec in plan.loads:
            timer = _Timer()
            if spec.in_background:
                future = timer.watch(self._retrieve(spec))
                self._loading.setdefault(spec.req_id, []).append((spec, future, timer))
            else:
                self._settle_load(spec, timer.watch(self._retrieve_now(spec)), timer)

    def finished_loading(self) -> set[str]:
        """Background loads done since the last call, every group's (their failed blocks are in
        `take_load_errors` now)."""
        done = {req_id for req_id, loads in self._loading.items() if all(load[1].done() for load in loads)}
        for req_id in done:
            for load in self._loading.pop(req_id):
                self._settle_load(*load)
        return done

    def start_stores(self, plan: StepPlan) -> None:
        """Start the plan's stores (after the forward pass that computed them)."""
        for spec in plan.stores:
            self._saving.add(spec.req_id)
            timer = _Timer()
            future = timer.watch(self._store(spec))
            self._inflight.setdefault(spec.req_id, []).append((future, timer, spec.group == self._counted_group))
            if spec.group in self._windowed_groups:
                self._windowed_stores.append(future)
                self._supersede(spec)

    def settle_windowed_stores(self) -> None:
        """Wait for the windowed groups' stores started so far (before a forward pass that may reuse their
        blocks); their results are collected with the request's other stores."""
        stores, self._windowed_stores = self._windowed_stores, []
        wait_all(stores)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Wait for these requests' stores (their blocks are about to be reused) and forget them: vLLM frees a
        preempted request's blocks itself."""
        for req_id in req_ids:
            self._wait_for_stores(req_id)
            self._saving.discard(req_id)
            self._finished.discard(req_id)

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the requests vLLM finished (now or earlier) and keeps blocks for, those whose stores are done."""
        self._finished.update(r for r in finished_req_ids if r in self._saving)
        done = set()
        for req_id in list(self._finished):
            if not all(_ended(future) for future, _, _ in self._inflight.get(req_id, [])):
                continue
            self._wait_for_stores(req_id)  # all ended: collect their results and errors
            done.add(req_id)
        self._finished -= done
        self._saving -= done
        return done

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes their tokens); with one KV cache group
        only (see `take_failed_loads`)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests whose load came back short since the last call, with several KV cache groups: their block ids
        are per group, so the engine recomputes the whole request. Such a model must load in the background
        (vLLM takes a failed request only from a load it waits for)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def take_load_report(self) -> tuple[set[str], set[str]]:
        """(requests whose loads ran since the last call, those of them that came back short)."""
        report = self._loads_done, self._loads_failed
        self._loads_done, self._loads_failed = set(), set()
        return report

    def refuse_transfers(self) -> None:
        """From now on every load fails (reported as any failed load: vLLM recomputes its tokens) and no store runs
        (its request is still reported done when it finishes); transfers in flight end as they would."""
        self._backends = [_Refusing()] * len(self._backends)

    def adopt_backends(self, other: WorkerSide) -> None:
        """Transfers go through ``other``'s backends (the KV registered again after vLLM's sleep) from now on."""
        self._backends, self._after_load = other._backends, other._after_load

    def drain(self) -> None:
        """Wait until no load or store runs (their results stay to be reported as usual)."""
        running = [load[1] for loads in self._loading.values() for load in loads]
        running += [store[0] for stores in self._inflight.values() for store in stores]
        wait_all(running)

    def close(self) -> None:
        """Wait for every load and store still running (they read or write vLLM's blocks)."""
        for loads in list(self._loading.values()):
            for spec, future, timer in loads:
                self._settle_load(spec, future, timer)
        self._loading.clear()
        for req_id in list(self._inflight):
            self._wait_for_stores(req_id)

    # -- helpers ---------------------------------------------------------------------------------------------

    def _retrieve(self, spec: LoadSpec) -> Future[int]:
        try:
            backend = self._backends[spec.group]
            if spec.located is not None and isinstance(backend, ServerBackend):  # it copies what the lookup located
                future = backend.retrieve_async(spec.tokens, spec.block_ids, spec.skip_tokens, spec.located)
            else:
                future = backend.retrieve_async(spec.tokens, spec.block_ids, spec.skip_tokens)
            return _HANDOFF.watch(future)
        except Exception as exc:
            return failed_future(exc)

    def _retrieve_now(self, spec: LoadSpec) -> Future[int]:
        """A foreground load run to its end by the backend on this thread, as a done future."""
        done: Future[int] = Future()
        try:
            backend = self._backends[spec.group]
            if spec.located is not None and isinstance(backend, ServerBackend):
                done.set_result(backend.retrieve(spec.tokens, spec.block_ids, spec.skip_tokens, spec.located))
            else:
                done.set_result(backend.retrieve(spec.tokens, spec.block_ids, spec.skip_tokens))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def _settle_load(self, spec: LoadSpec, future: Future[int], timer: _Timer) -> None:
        target = len(spec.tokens)
        try:
            got = future.result()
        except Exception as exc:
            if not isinstance(exc, ServerDown):  # the link already said the server is down, once
                log.warning("kvferry: loading request %s failed: %s: %s", spec.req_id, type(exc).__name__, exc)
            got = spec.skip_tokens
        counted = spec.group == self._counted_group
        block_size = self._block_sizes[spec.group]
        if counted:
            self.counters.loads += 1
            self.counters.load_seconds += timer.seconds
        self._loads_done.add(spec.req_id)
        if got < target:
            if len(self._backends) > 1:  # a block id names no block without its group: the request is reported
                self._failed_loads.add(spec.req_id)
            else:
                self._load_errors.update(spec.block_ids[max(got, spec.skip_tokens) // block_size :])
            if spec.req_id not in self._loads_failed:  # once per request, as `loads` counts it, whatever its groups
                self.counters.load_failures += 1
            self._loads_failed.add(spec.req_id)
            log.warning(
                "kvferry: request %s: loaded %d of %d tokens; vLLM recomputes the rest", spec.req_id, got, target
            )
        if not counted:
            return
        self.counters.tokens_loaded += max(0, min(got, target) - spec.skip_tokens)
        if self._after_load is not None:
            written = spec.block_ids[spec.skip_tokens // block_size : -(-min(got, target) // block_size)]
            if written:
                self._after_load(written)

    def _store(self, spec: StoreSpec) -> Future[int]:
        try:
            backend = self._backends[spec.group]
            return _HANDOFF.watch(backend.store_async(spec.tokens, spec.block_ids, spec.skip_tokens))
        except Exception as exc:  # a store is best effort: a failed one is a later cache miss
            return failed_future(exc)

    def _supersede(self, spec: StoreSpec) -> None:
        """Note the windowed chunks ``spec``'s store supersedes. A request's stores reach further step by step (one
        token list each): their chunks join into one range, named by the longest tokens, which extend the others."""
        backend = self._backends[spec.group]
        chunks = backend.superseded(spec.tokens, spec.skip_tokens) if isinstance(backend, WindowedBackend) else None
        if not chunks:
            return
        groups = self._superseded.setdefault(spec.req_id, {})
        tokens = spec.tokens
        before = groups.get(spec.group)
        if before is not None:
            tokens = max(tokens, before[0], key=len)
            chunks = range(min(before[1].start, chunks.start), max(before[1].stop, chunks.stop))
        groups[spec.group] = (tokens, chunks)

    def _wait_for_stores(self, req_id: str) -> None:
        """Collect the request's store results, then demote the windowed chunks they superseded."""
        self._collect_stores(req_id)
        for group, (tokens, chunks) in self._superseded.pop(req_id, {}).items():
            backend = self._backends[group]
            if not isinstance(backend, WindowedBackend):  # transfers refused since: nothing goes to the cache
                continue
            try:
                backend.demote(tokens, chunks)
            except Exception as exc:  # a demotion only orders eviction: without it, LRU's order stands
                log.warning("kvferry: demoting request %s's superseded chunks failed: %s", req_id, exc)

    def _collect_stores(self, req_id: str) -> None:
        for future, timer, counted in self._inflight.pop(req_id, []):
            try:
                stored = copied(future)
            except Exception as exc:
                self.counters.store_failures += 1
                if not isinstance(exc, ServerDown):
                    log.warning("kvferry: a store for request %s failed (a later lookup misses): %s", req_id, exc)
                stored = 0
            if counted:
                self.counters.tokens_stored += stored
                self.counters.stores += 1
                self.counters.store_seconds += timer.seconds


def _ended(store: Future[int]) -> bool:
    """Whether a store has ended for the engine: done, or its copy has ended (its blocks may be reused:
    `kvferry.connector.copy_ends`); a copy that failed on the GPU has ended too (its future raises it)."""
    if store.done():
        return True
    probe = copied_probe(store)
    try:
        return probe is not None and probe()
    except Exception:
        return True


class ConnectorOff(ServerDown):
    """The connector is off: the transfer was not started (logged once, when it turned off)."""


class _Refusing:
    """A backend that starts nothing: each transfer is a future failed with `ConnectorOff`."""

    def retrieve_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self._refused()

    def retrieve(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> int:
        raise ConnectorOff("the kvferry connector is off")

    def store_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self._refused()

    @staticmethod
    def _refused() -> Future[int]:
        refused: Future[int] = Future()
        refused.set_exception(ConnectorOff("the kvferry connector is off"))
        return refused


class _Timer:
    """From its creation to the end of the future it watches (set on the thread that ends it)."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._ended: float | None = None

    def watch(self, future: Future[int]) -> Future[int]:
        future.add_done_callback(self._end)
        return future

    def _end(self, _: Future[int]) -> None:
        self._ended = time.perf_counter()

    @property
    def seconds(self) -> float:
        return (self._ended or time.perf_counter()) - self._started
