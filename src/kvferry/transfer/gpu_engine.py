"""The GPU data path: engine blocks on the GPU <-> chunk objects in pinned host memory, at the PCIe limit.

Why gather + DMA: a kernel that reads or writes pinned host memory directly (zero-copy) reaches the link but keeps
SMs busy for the whole transfer and halves a concurrent GEMM (LIMITS.md); a Triton gather into a GPU staging slot
runs at >1 TB/s and leaves the PCIe crossing to the copy engine, which costs the model nothing. The two are
pipelined over a small ring of staging slots: the gather of slice i+1 overlaps the DMA of slice i.

Slices are whole objects grouped by bytes (about half a slot each), not by a fixed number of chunks: small models'
3 MiB chunks would otherwise be launch-bound. Each direction has its own kernel stream, copy stream and ring, so a
store and a retrieve can be in flight at once. A request orders itself after the caller's current stream with an
event and never blocks it; the caller gets a `TransferHandle` to poll or wait on, and the CPU returns right after
enqueueing. Below a size crossover, or when configured, the request runs zero-copy in one launch (lower latency).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvferry.kernels import triton_copy

MiB = 1 << 20


@dataclass
class TransferHandle:
    """Completion of one enqueued request. Keeps the request's tensors alive until the GPU is done with them."""

    event: torch.cuda.Event
    nbytes: int
    mode: str
    _keepalive: list[object] = field(default_factory=list, repr=False)

    def done(self) -> bool:
        if self.event.query():
            self._keepalive.clear()
            return True
        return False

    def wait(self) -> None:
        """Block the calling CPU thread until the bytes have moved."""
        self.event.synchronize()
        self._keepalive.clear()

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for this transfer, without blocking the CPU."""
        (stream or torch.cuda.current_stream()).wait_event(self.event)


class _Lane:
    """One direction's streams, staging ring and request-metadata ring (all allocated once)."""

    META_SLOTS = 4
    META_INTS = 1 << 16  # block ids + object tables of one request; larger requests pin a one-off buffer

    def __init__(self, device: torch.device, slots: int, slot_bytes: int) -> None:
        self.kernel_stream = torch.cuda.Stream(device)
        self.copy_stream = torch.cuda.Stream(device)
        self.slot_bytes = slot_bytes
        self.staging = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
        self.slot_free = [torch.cuda.Event() for _ in range(slots)]
        self.slot_ready = [torch.cuda.Event() for _ in range(slots)]
        self.next_slot = 0
        self.meta_host = torch.empty((self.META_SLOTS, self.META_INTS), dtype=torch.int64, pin_memory=True)
        self.meta_host_np = self.meta_host.numpy()
        self.meta_dev = torch.empty((self.META_SLOTS, self.META_INTS), dtype=torch.int64, device=device)
        self.meta_uploaded = [torch.cuda.Event() for _ in range(self.META_SLOTS)]  # host slot reusable
        self.meta_released = [torch.cuda.Event() for _ in range(self.META_SLOTS)]  # device slot reusable
        self.next_meta = 0
        self.lock = threading.Lock()

    def upload(self, parts: list[np.ndarray | list[int]]) -> tuple[torch.Tensor, int | None]:
        """Copy request metadata to the device; the kernel stream waits for it. Call with the copy stream current.

        Returns (device tensor, ring slot or None for a one-off buffer).
        """
        n = sum(len(p) for p in parts)
        done = torch.cuda.Event()
        if n > self.META_INTS:
            host = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])).pin_memory()
            dev = torch.empty(n, dtype=torch.int64, device=self.meta_dev.device)
            dev.record_stream(self.kernel_stream)
            dev.copy_(host, non_blocking=True)
            done.record(self.copy_stream)
            self.kernel_stream.wait_event(done)
            return dev, None
        k = self.next_meta
        self.next_meta = (k + 1) % self.META_SLOTS
        self.meta_uploaded[k].synchronize()  # the previous upload from this pinned slot has left it
        row = self.meta_host_np[k]
        at = 0
        for p in parts:
            row[at : at + len(p)] = p
            at += len(p)
        self.copy_stream.wait_event(self.meta_released[k])  # kernels of an earlier request are done with it
        self.meta_dev[k, :n].copy_(self.meta_host[k, :n], non_blocking=True)
        self.meta_uploaded[k].record(self.copy_stream)
        self.kernel_stream.wait_event(self.meta_uploaded[k])
        return self.meta_dev[k, :n], k


@dataclass(frozen=True)
class EngineConfig:
    """Staging ring per direction (slots x slot_bytes), slice target, and the zero-copy crossover."""

    slots: int = 2
    slot_bytes: int = 64 * MiB
    slice_bytes: int | None = None  # default: half a slot
    zero_copy_below: int = 4 * MiB  # requests smaller than this run zero-copy (see docs/gpu_data_path.md)
    mode: str = "auto"  # "auto" | "staged" | "zero_copy"


class TransferEngine:
    """Owns the streams and staging of one GPU; `submit` enqueues one request and returns a handle."""

    def __init__(self, device: torch.device | str | int = "cuda", config: EngineConfig | None = None) -> None:
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = config or EngineConfig()
        if self.config.mode not in ("auto", "staged", "zero_copy"):
            raise ValueError(f"mode={self.config.mode!r} must be 'auto', 'staged' or 'zero_copy'")
        with torch.cuda.device(self.device):
            self._store = _Lane(self.device, self.config.slots, self.config.slot_bytes)
            self._retrieve = _Lane(self.device, self.config.slots, self.config.slot_bytes)

    def submit(
        self,
        plan: triton_copy.TritonPlan,
        objects: list[torch.Tensor],
        block_ids: torch.Tensor,
        to_objects: bool,
        chunk_size: int,
        skip_prefix_blocks: int,
        mode: str | None = None,
    ) -> TransferHandle:
        """Enqueue a validated request (see `kvferry.transfer.check_request`); objects are pinned host tensors."""
        lane = self._store if to_objects else self._retrieve
        bs = plan.bs
        n_ids = len(block_ids)
        nbytes = (n_ids - skip_prefix_blocks) * bs * plan.bytes_per_token
        mode = mode or self.config.mode
        if mode == "auto":
            mode = "zero_copy" if nbytes < self.config.zero_copy_below else "staged"
        caller = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event()
        start.record(caller)
        if nbytes == 0:
            return TransferHandle(event=start, nbytes=0, mode=mode)
        ptrs = [o.data_ptr() for o in objects]
        caps = [o.shape[2] for o in objects]
        if mode == "zero_copy" or (to_objects and skip_prefix_blocks * bs % chunk_size):
            for i, p in enumerate(ptrs):  # the kernel addresses objects in words
                if p % plan.word:
                    raise ValueError(f"objects[{i}] is not {plan.word}-byte aligned (allocate from kvferry's pool)")
        ks = lane.kernel_stream
        ids_np = block_ids.numpy()
        with lane.lock, _current(lane.copy_stream, caller):  # one stream switch per request
            ks.wait_event(start)
            if mode == "zero_copy":
                meta, slot = lane.upload([ids_np, [(p - ptrs[0]) // plan.word for p in ptrs], caps])
                ids, table = meta[:n_ids], meta[n_ids:].view(2, -1)
                rows = (n_ids - skip_prefix_blocks) * bs
                triton_copy.launch(plan, objects[0], table, ids, to_objects, chunk_size, skip_prefix_blocks * bs,
                                   rows, ks)  # fmt: skip
                end = ks
            else:
                meta, slot = self._staged(lane, plan, objects, ptrs, caps, ids_np, to_objects, chunk_size,
                                          skip_prefix_blocks)  # fmt: skip
                end = lane.copy_stream if to_objects else ks
            if slot is not None:
                lane.meta_released[slot].record(ks)
            done = torch.cuda.Event()
            done.record(end)
        return TransferHandle(event=done, nbytes=nbytes, mode=mode, _keepalive=[objects, meta])

    def _staged(
        self,
        lane: _Lane,
        plan: triton_copy.TritonPlan,
        objects: list[torch.Tensor],
        ptrs: list[int],
        caps: list[int],
        ids_np: np.ndarray,
        to_objects: bool,
        chunk_size: int,
        skip: int,
    ) -> tuple[torch.Tensor, int | None]:
        bs = plan.bs
        per_object = chunk_size // bs
        word = plan.word
        sizes = [c * plan.bytes_per_token for c in caps]
        first = skip // per_object  # objects before this one are skipped entirely
        # A store must not overwrite the skipped head of a partly skipped object: that object goes zero-copy.
        head = to_objects and skip % per_object != 0
        slices = self._slices(sizes, first + head, lane.slot_bytes)
        n_slots = len(lane.slot_free)
        offsets = [0] * len(objects)
        slot_of: list[int] = []
        for n, members in enumerate(slices):
            slot = (lane.next_slot + n) % n_slots
            slot_of.append(slot)
            cursor = slot * lane.slot_bytes
            for o in members:
                offsets[o] = cursor // word
                cursor += sizes[o]
        lane.next_slot = (lane.next_slot + len(slices)) % n_slots
        ks, cs = lane.kernel_stream, lane.copy_stream
        n_ids = len(ids_np)
        meta, meta_slot = lane.upload([ids_np, offsets, caps, [0, caps[first]]])
        ids, table = meta[:n_ids], meta[n_ids : n_ids + 2 * len(objects)].view(2, -1)
        if head:
            head_ids = ids[first * per_object : first * per_object + caps[first] // bs]
            head_rows = skip % per_object * bs
            triton_copy.launch(plan, objects[first], meta[n_ids + 2 * len(objects) :].view(2, 1), head_ids, True,
                               chunk_size, head_rows, caps[first] - head_rows, ks)  # fmt: skip
        staging = lane.staging
        # The copy stream is current (see submit); kernels name their stream.
        for members, slot in zip(slices, slot_of, strict=True):
            row0 = max(members[0] * chunk_size, skip * bs)
            row1 = members[0] * chunk_size + sum(caps[o] for o in members)
            ready = lane.slot_ready[slot]
            if to_objects:
                ks.wait_event(lane.slot_free[slot])
                triton_copy.launch(plan, staging, table, ids, True, chunk_size, row0, row1 - row0, ks)
                ready.record(ks)
                cs.wait_event(ready)
                self._dma(objects, members, ptrs, sizes, staging, offsets, word, to_host=True)
                lane.slot_free[slot].record(cs)
            else:
                cs.wait_event(lane.slot_free[slot])
                self._dma(objects, members, ptrs, sizes, staging, offsets, word, to_host=False)
                ready.record(cs)
                ks.wait_event(ready)
                triton_copy.launch(plan, staging, table, ids, False, chunk_size, row0, row1 - row0, ks)
                lane.slot_free[slot].record(ks)
        return meta, meta_slot

    def _slices(self, sizes: list[int], first: int, slot_bytes: int) -> list[list[int]]:
        """Consecutive objects grouped into slices of about `slice_bytes` (whole objects, one slot at most)."""
        # About a quarter of the request per slice (so even a small request overlaps its gather with its DMA),
        # at least 4 MiB (below that the copy engine and launches dominate), at most half a slot.
        total = sum(sizes[first:])
        target = self.config.slice_bytes or min(slot_bytes // 2, max(4 * MiB, total // 4))
        slices: list[list[int]] = []
        size = 0
        for o in range(first, len(sizes)):
            if sizes[o] > slot_bytes:
                raise ValueError(
                    f"a chunk object of {sizes[o]} bytes does not fit a {slot_bytes}-byte staging slot: "
                    "raise EngineConfig.slot_bytes or lower the chunk size"
                )
            if slices and size + sizes[o] <= target:
                slices[-1].append(o)
                size += sizes[o]
            else:
                slices.append([o])
                size = sizes[o]
        return slices

    @staticmethod
    def _dma(
        objects: list[torch.Tensor],
        members: list[int],
        ptrs: list[int],
        sizes: list[int],
        staging: torch.Tensor,
        offsets: list[int],
        word: int,
        to_host: bool,
    ) -> None:
        """One copy per run of objects that are adjacent in host memory (and so in staging)."""
        run_start = members[0]
        for k, o in enumerate(members):
            nxt = members[k + 1] if k + 1 < len(members) else None
            if nxt is not None and ptrs[o] + sizes[o] == ptrs[nxt] and _same_storage(objects[o], objects[nxt]):
                continue
            nbytes = ptrs[o] + sizes[o] - ptrs[run_start]
            host = _byte_view(objects[run_start], nbytes)
            dev = staging[offsets[run_start] * word : offsets[run_start] * word + nbytes]
            if to_host:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
            if nxt is not None:
                run_start = nxt


@contextlib.contextmanager
def _current(stream: torch.cuda.Stream, previous: torch.cuda.Stream) -> Iterator[None]:
    """Make `stream` current and restore `previous` (cheaper than torch.cuda.stream, which re-queries both)."""
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _byte_view(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of host memory starting at t (objects adjacent to t in the same storage)."""
    storage = t.untyped_storage()
    start = t.data_ptr() - storage.data_ptr()
    return torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,))


_engines: dict[torch.device, TransferEngine] = {}
_engines_lock = threading.Lock()


def default_engine(device: torch.device) -> TransferEngine:
    """One engine per GPU for the synchronous `kvferry.transfer` (created on first use)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _engines_lock:
        if device not in _engines:
            _engines[device] = TransferEngine(device)
        return _engines[device]
