"""The GPU data path: engine blocks on the GPU <-> chunk objects in pinned host memory, at the PCIe limit.

Why gather + DMA: a kernel that reads or writes pinned host memory directly (zero-copy) reaches the link but keeps
SMs busy for the whole transfer and halves a concurrent GEMM (docs/gpu_data_path.md); a Triton gather into a GPU
staging slot runs at >1 TB/s and leaves the PCIe crossing to the copy engine, which costs the model nothing. The
two are pipelined over a small ring of staging slots: the gather of slice i+1 overlaps the DMA of slice i.

Slices are cut by bytes, not by a fixed number of chunks: small objects are grouped (qwen2.5-0.5b's 3 MiB chunks
would otherwise be launch-bound) and a large one is cut into ranges of its rows (so even a one-chunk request
overlaps its gather with its DMA, and an object may be larger than a slot).

Each direction has its own ring and one stream per slot, so a store and a retrieve can be in flight at once. A
slot's stream runs that slot's gathers (scatters) and DMAs in order, so the stream itself frees a slot for its next
slice: slices take no events, and a request takes a handful of event calls however many slices it has. A
request orders itself after the caller's current stream with an event (or after an event it is given:
`kvferry.transfer.ordered_after`) and never blocks it; the caller gets a `TransferHandle` to poll or wait on, and
the CPU returns right after enqueueing. Below a size crossover, or when configured, the request runs zero-copy in
one launch (lower latency).

The enqueue itself goes straight to the driver (`kvferry.cuda.driver`: memcpys, events, waits) and to the compiled
kernel's launcher: torch's copy and event wrappers cost more CPU than a small request's whole transfer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from kvferry.cuda.driver import CudaError, driver, primary_context
from kvferry.kernels import triton_copy, triton_plan
from kvferry.kernels.page_dma import PagePlan, page_copies
from kvferry.transfer.block_ids import PendingBlockIds
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.graphed import ObjectGraph, tables_bytes
from kvferry.transfer.handle import Completion, TransferHandle
from kvferry.transfer.lane import Lane, LeadDMA
from kvferry.transfer.schedule import Ring, Schedule, dma_runs, lead_bytes, lead_objects, schedule

if TYPE_CHECKING:
    from kvferry.transfer.request import Checked

log = logging.getLogger(__name__)
_NO_IDS = np.empty(0, dtype=np.int64)  # a request's ids while their check is pending (`_staged` fills them in)
_GRAPHS_PER_PLAN = 16  # request shapes x lanes: an engine's plan meets one or two shapes per direction


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~2 us to build, a one-chunk request's enqueue ~20
class _Request:
    """One validated request as the engine moves it: the plan, and the host side read off `Checked` (or off the
    objects themselves). Built once per request and only read after."""

    plan: triton_plan.TritonPlan
    objects: list[torch.Tensor] | torch.Tensor | list[int]  # kept alive until the request has run
    ids: np.ndarray  # block ids (int64)
    ptrs: list[int]  # each object's host address
    caps: list[int]  # each object's capacity in tokens
    rows: int  # rows per object (plane * NL + layer)
    one_allocation: bool  # every object in one pinned allocation: one DMA may run across neighbours
    to_objects: bool
    chunk_size: int
    skip: int  # leading blocks not copied


class TransferEngine:
    """Owns the streams and staging of one GPU; `submit` enqueues one request and returns a handle."""

    def __init__(self, device: torch.device | str | int = "cuda", config: EngineConfig | None = None) -> None:
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = config or EngineConfig()
        self._driver = driver()
        # The primary context, made current first: a thread that never made a CUDA runtime call has none current
        # even with the device selected (a cache's worker thread or a server's may be the first to transfer), and
        # the lanes' events are made by driver calls.
        self._context = primary_context(self.device)
        with torch.cuda.device(self.device), self._driver.current(self._context):
            lane = (self._driver, self.device, self.config.slots, self.config.slot_bytes, self.config.kernel_priority)
            self._store = Lane(*lane)
            self._retrieve = Lane(*lane)
        self._schedules: dict[tuple[object, ...], Schedule] = {}  # staged request shapes seen (a small cache)
        self._batch = self.config.batch_dma and self._driver.has_batch
        self._graphs_failed = not self.config.graph_max_bytes

    def submit(
        self,
        plan: triton_plan.TritonPlan,
        objects: list[torch.Tensor] | torch.Tensor | list[int],
        request: Checked | torch.Tensor,
        to_objects: bool,
        chunk_size: int,
        skip_prefix_blocks: int,
        mode: str | None = None,
        after: int | None = None,
        lead: LeadDMA | None = None,
    ) -> TransferHandle:
        """Enqueue a validated request (`kvferry.transfer.request.check`) on pinned host objects. `request` is the
        `Checked` result, or just the block ids of a list of objects (their addresses are then read here). The
        request's kernels wait for the caller's current stream, or for the CUDA event `after` when given. `lead`:
        this retrieve's first DMA, started by `lead` (used where it is this request's first DMA; released either
        way)."""
        ids: np.ndarray | PendingBlockIds[np.ndarray]
        if isinstance(request, torch.Tensor):
            assert not isinstance(objects, torch.Tensor)
            tensors = cast("list[torch.Tensor]", objects)  # block ids alone come only with a list of tensors
            ids, ptrs = request.numpy(), [o.data_ptr() for o in tensors]
            caps = [o.shape[2] for o in tensors]
            rows, one_allocation = tensors[0].shape[0] * tensors[0].shape[1], False  # pairs compared by storage
        else:
            ids, ptrs, caps, rows = request.ids, request.ptrs, request.caps, request.rows
            one_allocation = request.one_allocation
        pending, known = (ids, _NO_IDS) if isinstance(ids, PendingBlockIds) else (None, ids)
        req = _Request(plan, objects, known, ptrs, caps, rows, one_allocation, to_objects, chunk_size,
                       skip_prefix_blocks)  # fmt: skip
        lane = self._store if to_objects else self._retrieve
        if lead is not None and (lead.lane is not lane or not lead.held):  # another engine's, or a store
            lead.release()
            lead = None
        nbytes = (len(ids) - skip_prefix_blocks) * plan.bs * plan.bytes_per_token
        mode = mode or self.config.mode
        pages = plan.pages if self._batch else None
        if mode == "page_dma" and pages is None:  # asked for by name only: "auto" never picks it (page_dma.py)
            raise ValueError("page DMA needs a layout whose pages are runs of object rows and cuMemcpyBatchAsync")
        graphed = (mode in ("auto", "staged") and len(ptrs) == 1 and not skip_prefix_blocks and not plan.partial_rows
                   and len(ids) * plan.bs == caps[0] and 0 < nbytes <= self.config.graph_max_bytes
                   and nbytes + tables_bytes(len(ids)) <= self.config.slot_bytes
                   and not self._graphs_failed)  # fmt: skip
        if plan.partial_rows:  # staging rows would be whole object rows: a DMA of them would overwrite other heads
            mode = "zero_copy"
        elif graphed:
            mode = "staged"
        elif mode == "auto":
            mode = "zero_copy" if nbytes < self.config.zero_copy_below else "staged"
        if pending is not None and (mode != "staged" or to_objects or graphed or not nbytes):  # checked up front
            req.ids, pending = pending.check(), None
        if mode == "zero_copy" or (to_objects and skip_prefix_blocks * plan.bs % chunk_size):
            for i, p in enumerate(ptrs):  # the kernel addresses objects in words
                if p % plan.word:
                    raise ValueError(f"objects[{i}] is not {plan.word}-byte aligned (allocate from kvferry's pool)")
        d = self._driver
        # the GPU work first: bookkeeping after it costs no latency
        if lead is None:
            lane.lock.acquire()
        try:
            with d.current(self._context):
                done = Completion(d, self._context, lane.ref)
                end: int | None = None  # the stream the request ends on
                if after is None:  # what the request's kernels wait for (its DMAs to and from staging do not)
                    end = torch._C._cuda_getCurrentRawStream(self.device.index)
                    d.record(lane.start, end)
                    start = lane.start
                else:
                    start = after
                keep: object = None
                graph = graphed and self._graph(lane, req)
                if graph:
                    meta, keep = lane.upload([req.ids, [0, caps[0]]], len(ids) + 2, done, graph.stream, to_device=False)
                    graph.launch(ptrs[0], meta, start)
                    keep, end = (keep, graph), graph.stream  # the graph stays until the request has run
                elif nbytes and mode == "page_dma":
                    assert pages is not None
                    keep, end = self._pages(lane, req, pages, start)
                elif nbytes and mode == "zero_copy":
                    keep, end = self._zero_copy(lane, req, done, start)
                elif nbytes:
                    keep, end = self._staged(lane, req, done, start, pending, lead)
                if end is None:  # nothing to copy, and no caller's stream: done once `after` is
                    end = lane.handles[lane.next_slot]
                    d.wait(end, start, 0)
                d.record(done.event, end)  # also frees its metadata slot (`Lane.upload`)
                lane.retire()
                # The plan too: its kernels read its device tables when they run, maybe long after a caller dropped
                # the plan (`forget_plans`, the layout LRU); freed then, a table could be reused by another upload.
                lane.inflight.append((done, (objects, keep, plan)))
        finally:
            if lead is None:
                lane.lock.release()
            else:
                lead.release()
        return TransferHandle(done, nbytes, mode)

    def lead(
        self,
        host: int,
        object_bytes: int,
        rows: int,
        n_objects: int,
        following: Callable[[int], Sequence[int]] | None = None,
    ) -> LeadDMA | None:
        """Start the first DMA of a retrieve of `n_objects` whole pool objects of `object_bytes` (`rows` rows each)
        from the first one's pinned address `host`, into the retrieve lane's next staging slot, before the request
        is known whole (its other objects looked up, its block ids checked): it touches no KV and waits for
        nothing. Where the first slice joins several objects, `following(k)` gives the addresses of up to `k` of
        the request's next objects (held by the caller until the request has run), and the DMA covers those that
        lie back to back from `host` too. The lane stays held until the request's `submit(..., lead=)` (which skips
        what it covered of its first slice) or `LeadDMA.release`. None where the request would not start with such
        a DMA."""
        cfg, lane = self.config, self._retrieve
        small = cfg.mode == "auto" and n_objects * object_bytes < cfg.zero_copy_below
        if cfg.mode not in ("auto", "staged") or n_objects < 2 or small:
            return None  # zero-copy, page DMA, or a one-object (graphed) request: no staged first slice
        run = 1
        joined = lead_objects(n_objects, object_bytes, lane.slot_bytes, cfg.slice_bytes)
        if joined > 1 and following is not None:
            for address in following(joined - 1):
                if address != host + run * object_bytes:
                    break
                run += 1
        nbytes = lead_bytes(n_objects, object_bytes, rows, lane.slot_bytes, cfg.slice_bytes, run)
        if nbytes is None:
            return None
        lane.lock.acquire()
        try:
            slot = lane.next_slot
            with self._driver.current(self._context):
                self._driver.htod(lane.staging_ptr + slot * lane.slot_bytes, host, nbytes, lane.handles[slot])
        except BaseException:
            lane.lock.release()
            raise
        return LeadDMA(lane, slot, host, nbytes)

    def _graph(self, lane: Lane, req: _Request) -> ObjectGraph | None:
        """The lane's graph for this request shape (one whole object), captured now if new; None where graphs cannot
        serve it (a plan holding as many as it keeps, or a driver that refused a capture: then this engine stops
        trying)."""
        plan, n_ids, cap, chunk_size, to_objects = req.plan, len(req.ids), req.caps[0], req.chunk_size, req.to_objects
        key = (lane.ref, n_ids, cap, chunk_size, to_objects)
        graph = plan.graphs.get(key)
        if graph is not None:
            return graph
        for k in [k for k in plan.graphs if k[0]() is None]:  # graphs of lanes gone (their engines were dropped)
            del plan.graphs[k]
        if len(plan.graphs) >= _GRAPHS_PER_PLAN:
            return None
        try:
            graph = ObjectGraph(
                self._driver,
                self._context,
                plan,
                n_ids=n_ids,
                cap=cap,
                rows=req.rows,
                chunk_size=chunk_size,
                to_objects=to_objects,
                programs=self.config.programs,
                stream=lane.handles[0],
                slot=lane.staging_ptr,
                host=req.ptrs[0],
            )
        except CudaError as e:
            log.warning("CUDA graph capture failed (%s): one-object requests take the staged path", e)
            self._graphs_failed = True
            return None
        plan.graphs[key] = graph
        return graph

    def _pages(self, lane: Lane, req: _Request, pages: PagePlan, start: int) -> tuple[object, int]:
        """Every page as one copy of one batch on a slot stream, after `start` (both directions touch KV)."""
        dev, host, sizes = page_copies(pages, req.ids, req.ptrs, req.caps, req.chunk_size, req.skip)
        stream = lane.handles[lane.next_slot]
        self._driver.wait(stream, start, 0)
        if req.to_objects:
            self._driver.copy_pages(host, dev, sizes, stream)
        else:
            self._driver.copy_pages(dev, host, sizes, stream)
        return (dev, host, sizes), stream

    def _zero_copy(self, lane: Lane, req: _Request, done: Completion, start: int) -> tuple[object, int]:
        plan, ptrs, ids, skip = req.plan, req.ptrs, req.ids, req.skip
        n_ids, n_obj = len(ids), len(ptrs)
        offsets = [(p - ptrs[0]) // plan.word for p in ptrs]
        stream = lane.handles[lane.next_slot]
        meta, keep = lane.upload([ids, offsets, req.caps], n_ids + 2 * n_obj, done, stream, to_device=False)
        self._driver.wait(stream, start, 0)
        off = meta + n_ids * 8
        rows = (n_ids - skip) * plan.bs
        triton_copy.launch_raw(plan, stream, ptrs[0], off, off + n_obj * 8, meta, req.to_objects, req.chunk_size,
                               skip * plan.bs, rows)  # fmt: skip
        return keep, stream

    def _staged(
        self,
        lane: Lane,
        req: _Request,
        done: Completion,
        start: int,
        pending: PendingBlockIds[np.ndarray] | None,
        early: LeadDMA | None,
    ) -> tuple[object, int]:
        """Each slice runs on its slot's stream: gather then DMA (a store), or DMA then scatter (a retrieve). The
        next slice, on the next slot's stream, overlaps it; the slice after that waits for it by stream order.

        A retrieve's first slice on each slot is DMA'd into staging before anything else (its block ids checked
        when `pending`, the metadata uploaded): those DMAs touch no KV and wait for nothing, and the host work after
        them overlaps them. A pending check that fails then leaves only staging written. `early`: the first of
        those DMAs, already enqueued (`lead`) where it is this request's first slice's first parts."""
        plan, ptrs, caps, rows = req.plan, req.ptrs, req.caps, req.rows
        to_objects, chunk_size, skip = req.to_objects, req.chunk_size, req.skip
        key = (tuple(caps), skip, rows, chunk_size, plan.bs, plan.bytes_per_token, plan.word, to_objects,
               lane.next_slot)  # fmt: skip
        sched = self._schedules.get(key)
        if sched is None:
            if len(self._schedules) >= 256:
                self._schedules.clear()
            ring = Ring(lane.staging_ptr, lane.slot_bytes, len(lane.handles), lane.next_slot)
            sched = schedule(
                caps,
                rows=rows,
                to_objects=to_objects,
                chunk_size=chunk_size,
                skip=skip,
                bs=plan.bs,
                bytes_per_token=plan.bytes_per_token,
                word=plan.word,
                ring=ring,
                slice_bytes=self.config.slice_bytes,
            )
            self._schedules[key] = sched
        d, handles = self._driver, lane.handles
        home = handles[lane.next_slot]  # the request's first slice (the schedule starts there)
        lane.next_slot = sched.next_slot
        lead = () if to_objects else sched.lead  # a retrieve's steps whose DMA goes first
        covered = early.covered(sched.steps[0], ptrs) if early is not None and sched.steps else 0
        for i in lead:
            step = sched.steps[i]
            parts = step.parts[covered:] if i == 0 else step.parts  # the first slice's: what the lead did not DMA
            if parts:
                self._dma(handles[step.slot], parts, req, False)
        if pending is not None:
            req.ids = pending.check()
        ids = req.ids
        n_ids = len(ids)
        meta, keep = lane.upload([ids, sched.tables], n_ids + len(sched.tables) // 8, done, home)
        # The other slot streams' kernels wait for the upload on `meta_ready`. Recorded after the first kernel on
        # `home` (one driver call fewer before the first GPU operation; those kernels then wait for it too, a few
        # us, while the first DMA runs), except behind a zero-copy head kernel, which may run for a whole chunk.
        ready = len(sched.slots) == 1
        if not ready and sched.head_rows:
            d.record(lane.meta_ready, home)
            ready = True
        off, cap = meta + n_ids * 8, meta + (n_ids + len(caps)) * 8
        launch_raw, wait = triton_copy.launch_raw, d.wait
        ordered: set[int] = set()  # streams already waiting for the caller's stream (and the metadata)
        if sched.head_rows:
            wait(home, start, 0)
            ordered.add(home)
            first, head_rows = sched.first, sched.head_rows
            tail = meta + (n_ids + 2 * len(caps)) * 8  # the [0, cap] table of the head object alone
            launch_raw(plan, home, ptrs[first], tail, tail + 8, meta + first * (chunk_size // plan.bs) * 8, True,
                       chunk_size, head_rows, caps[first] - head_rows)  # fmt: skip
        staging, programs = lane.staging_ptr, self.config.programs
        for i, step in enumerate(sched.steps):
            stream = handles[step.slot]
            if not to_objects and i not in lead:  # into staging: touches no KV, waits only for the slot's last scatter
                self._dma(stream, step.parts, req, False)
            if stream not in ordered:  # a gather sees what the model wrote; a scatter waits until the model is done
                wait(stream, start, 0)
                if stream != home:
                    wait(stream, lane.meta_ready, 0)
                ordered.add(stream)
            launch_raw(plan, stream, staging, off, cap, meta, to_objects, chunk_size, step.row0, step.n_rows,
                       step.rows, step.shift, programs)  # fmt: skip
            if not ready:  # the first step runs on `home`
                d.record(lane.meta_ready, home)
                ready = True
            if to_objects:
                self._dma(stream, step.parts, req, True)
        # The request ends on its last slice's stream, once its other streams' parts have run too.
        end = handles[sched.steps[-1].slot] if sched.steps else home
        for slot in sched.slots:
            if handles[slot] != end:
                d.record(lane.joined[slot], handles[slot])
                wait(end, lane.joined[slot], 0)
        return keep, end

    def _dma(self, stream: int, parts: tuple[tuple[int, int, int, int], ...], req: _Request, to_host: bool) -> None:
        """Copy a slice's ``parts`` (a `Step`'s) between its slot and host memory on the slot's stream.

        Scattered objects cost a DMA each: ~1.3 us apart and each ~3% slower than one long copy, so a slice of
        3 MiB objects loses ~5% (2 MiB ones ~9%). Where the driver has cuMemcpyBatchAsync they go as one batch.
        (Same-direction DMAs of two streams run one after another on the copy engine, measured.)"""
        d = self._driver
        if len(parts) == 1:  # one object, or a row range of one
            o, offset, n, dev = parts[0]
            host = req.ptrs[o] + offset
            d.dtoh(host, dev, n, stream) if to_host else d.htod(dev, host, n, stream)
            return
        # addresses alone (list[int]) come from one pool allocation: never compared by storage
        objects = cast("list[torch.Tensor] | torch.Tensor", req.objects)
        runs = dma_runs(objects, parts, req.ptrs, req.one_allocation)
        if len(runs) > 1 and self._batch:  # scattered objects: one batch for the copy engine
            hosts, devs, sizes = zip(*runs, strict=True)
            d.copy_batch(hosts, devs, sizes, stream) if to_host else d.copy_batch(devs, hosts, sizes, stream)
            return
        for host, dev, n in runs:
            d.dtoh(host, dev, n, stream) if to_host else d.htod(dev, host, n, stream)


_DEFAULT_CONFIG = EngineConfig()
_engines: dict[torch.device, TransferEngine] = {}
_engines_lock = threading.Lock()


def default_engine(device: torch.device, config: EngineConfig | None = None) -> TransferEngine:
    """One engine per GPU for `kvferry.transfer` (created on first use). A `config` other than the current engine's
    replaces it for later requests; the old one's streams drain before its staging is freed (`Lane.__del__`)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = config or _DEFAULT_CONFIG
    with _engines_lock:
        engine = _engines.get(device)
        if engine is None or (engine.config is not config and engine.config != config):  # `is`: ~1 us less
            engine = _engines[device] = TransferEngine(device, config)
        return engine
