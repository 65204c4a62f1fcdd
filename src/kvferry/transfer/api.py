"""`kvferry.transfer`: the seed's multi_layer_block_kv_transfer, one contract over three backends."""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvferry.formats import EngineKVFormat, KVGeometry
from kvferry.formats.codec import coded_versions
from kvferry.transfer.block_ids import BlockIds, CheckedBlockIds, PendingBlockIds
from kvferry.transfer.geometry_cache import GeometryCache
from kvferry.transfer.request import (
    Checked,
    Direction,
    Objects,
    as_objects,
    check,
    check_pinned,
    check_pool_addresses,
    check_pool_objects,
    object_list,
)

if TYPE_CHECKING:
    from kvferry.transfer.engine_config import EngineConfig
    from kvferry.transfer.gpu_engine import TransferEngine
    from kvferry.transfer.handle import TransferHandle
    from kvferry.transfer.lane import LeadDMA

Backend = Literal["auto", "reference", "torch", "triton"]
BACKENDS = ("auto", "reference", "torch", "triton")


def transfer(
    paged: Any,
    objects: Objects,
    block_ids: BlockIds,
    direction: Direction,
    fmt: EngineKVFormat | int,
    chunk_size: int = 256,
    skip_prefix_blocks: int = 0,
    backend: Backend = "auto",
    block_size: int | None = None,
    geometry: KVGeometry | None = None,
) -> None:
    """Copy KV between the engine's paged blocks and chunk objects; returns when the bytes have moved.

    Entry `i` of `block_ids` holds tokens `i*BS .. i*BS+BS-1`; object `o` holds entries
    `o*chunk/BS .. (o+1)*chunk/BS - 1` (the last object may hold fewer tokens, a multiple of BS). The first
    `skip_prefix_blocks` entries are not copied in either direction. Everything is validated before a byte moves.
    `objects` is a list of object tensors, or one tensor `[n, *object_shape]` of `n` whole objects back to back
    (cheaper to check; one DMA per slice on the GPU). `block_ids` checked already (`CheckedBlockIds`, from
    `check_block_ids`) are not checked again. Pass `geometry` (from `kvferry.formats.describe`) to skip
    re-validating the engine tensors on every call (without it, tensors described before are recognised by their
    addresses, shapes, strides and dtype: see `geometry_cache`).
    """
    geom = geometry if geometry is not None else _geometries.get(fmt, paged, block_size)
    if geometry is not None and EngineKVFormat(fmt) != geom.fmt:
        raise ValueError(f"fmt={EngineKVFormat(fmt).name} but the geometry describes {geom.fmt.name}")
    direction = _direction(direction)
    objs = as_objects(objects)
    checked = check(geom, objs, block_ids, direction, chunk_size, skip_prefix_blocks)
    chosen = _backend(backend, geom, objs, checked)
    to_objects = direction is Direction.D2H
    if geom.device.type == "cuda" and checked.on_host and chosen == "triton":  # the GPU data path
        _submit(geom, objs, checked, to_objects, chunk_size, skip_prefix_blocks, None, None).wait()
        return
    ids = torch.from_numpy(checked.ids)
    if chosen in ("reference", "torch"):
        copy = _exact_copy(chosen, geom, paged)
        if geom.codec is None:
            copy(object_list(objs), ids.to(geom.device), to_objects, chunk_size, skip_prefix_blocks)
        else:
            from kvferry.kernels.codec import copy_coded

            copy_coded(copy, geom, object_list(objs), ids.to(geom.device), to_objects, chunk_size, skip_prefix_blocks)
    else:
        from kvferry.kernels.triton_copy import copy_triton

        copy_triton(_plans.triton(geom), object_list(objs), ids.to(geom.device), to_objects, chunk_size,
                    skip_prefix_blocks)  # fmt: skip
        if geom.device.type == "cuda":
            torch.cuda.current_stream(geom.device).synchronize()


def _exact_copy(backend: str, geom: KVGeometry, paged: Any) -> Any:
    """The reference or torch backend's exact copy as `copy(objects, block ids, to_objects, chunk, skip)`."""
    if backend == "reference":
        from kvferry.kernels.reference import copy_reference

        return lambda objs, ids, to_objects, chunk, skip: copy_reference(
            geom, paged, objs, ids.tolist(), to_objects, chunk, skip
        )
    from kvferry.kernels.torch_copy import copy_torch

    return functools.partial(copy_torch, _plans.torch(geom))


def geometry_of(fmt: EngineKVFormat | int, paged: Any, block_size: int | None = None) -> KVGeometry:
    """`kvferry.formats.describe(fmt, paged, block_size)`, recognised without re-describing when these tensors (same
    addresses, shapes, strides, dtype) were described before; what `transfer` does when given no `geometry`."""
    return _geometries.get(fmt, paged, block_size)


def transfer_async(
    paged: Any,
    objects: Objects,
    block_ids: BlockIds,
    direction: Direction,
    fmt: EngineKVFormat | int,
    chunk_size: int = 256,
    skip_prefix_blocks: int = 0,
    block_size: int | None = None,
    geometry: KVGeometry | None = None,
    engine: TransferEngine | None = None,
    mode: str | None = None,
    lead: LeadDMA | None = None,
) -> TransferHandle:
    """Enqueue a transfer between GPU blocks and pinned host objects; returns at once with a handle.

    The request is ordered after the caller's current CUDA stream (the engine's compute), or after the event of
    `ordered_after` around the call, and never blocks it.
    Use `handle.wait_on(stream)` before the engine reads retrieved blocks, `handle.done()` to poll.
    """
    geom = geometry if geometry is not None else _geometries.get(fmt, paged, block_size)
    if geom.device.type != "cuda":
        raise ValueError(f"transfer_async moves GPU KV; the engine's KV is on {geom.device} (use transfer())")
    objs = as_objects(objects)
    direction = _direction(direction)
    checked = check(geom, objs, block_ids, direction, chunk_size, skip_prefix_blocks)
    if not checked.on_host:
        raise ValueError("transfer_async needs chunk objects in pinned host memory")
    check_pinned(objs, checked)
    return _submit(geom, objs, checked, direction is Direction.D2H, chunk_size, skip_prefix_blocks, engine, mode, lead)


def ordered_after(event: int) -> _OrderedAfter:
    """`with ordered_after(event):` GPU transfers this thread enqueues in the block wait, on the GPU, for the CUDA
    event `event` (a raw `CUevent` handle, e.g. `torch.cuda.Event.cuda_event`, recorded by now) instead of for its
    current stream.

    What a server does for a client's STORE: the client records an interprocess event after the work that writes
    the blocks, and the copy waits for that event itself. Making a stream current for it instead (a stream waiting
    on the event, `torch.cuda.set_stream`, the old stream put back) cost a STORE through the server ~70-110 us on
    the H200 host."""
    return _OrderedAfter(event)


def ordering_event() -> int | None:
    """The event of the `ordered_after` block the calling thread is in (None outside one): what its transfers wait
    for instead of its current stream, and so what a mark of where it stands (`stream_marks`) or a server
    transfer's ready event (`kvferry.client`) must come after."""
    return getattr(_order, "event", None)


class _OrderedAfter:
    """`ordered_after`'s block. A class, not a generator: it is entered twice per server transfer, once on the
    socket thread before the answer leaves (0.3 us against 1 us a generator's; CPU machine)."""

    __slots__ = ("_event", "_previous")

    def __init__(self, event: int) -> None:
        self._event = event
        self._previous: int | None = None

    def __enter__(self) -> None:
        self._previous = getattr(_order, "event", None)
        _order.event = self._event

    def __exit__(self, *exc: object) -> None:
        _order.event = self._previous


_order = threading.local()  # `ordered_after`'s event, per thread


def forget_plans(geometry: KVGeometry) -> None:
    """Drop the copy plans built for ``geometry``'s tensors (an engine's KV that is going away), so that nothing
    cached here keeps its memory alive."""
    for geom in (geometry, *coded_versions(geometry)):
        _plans.forget(geom)


def prepare_gpu(geometry: KVGeometry) -> None:
    """Build the GPU plan of `geometry` (an engine's registered KV) and compile its kernels for both directions, so
    that its first store and first retrieve run at full speed."""
    if geometry.device.type != "cuda":
        raise ValueError(f"prepare_gpu is for GPU KV; this KV is on {geometry.device}")
    from kvferry.kernels.triton_copy import compile_all

    compile_all(_plans.triton(geometry))


def transfer_pool_async(
    geom: KVGeometry,
    objects: list[torch.Tensor],
    block_ids: BlockIds | PendingBlockIds[CheckedBlockIds],
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
    lead: LeadDMA | None = None,
) -> TransferHandle:
    """`transfer_async` for whole chunk objects carved from a pinned `HostPool` (what the cache moves): checked by
    `check_pool_objects`, which skips what the pool guarantees (and leaves `PendingBlockIds` to the engine, which
    checks them once a retrieve's first DMAs into staging are in flight). Objects from anywhere else go through
    `transfer_async`."""
    if geom.device.type != "cuda":
        raise ValueError(f"transfer_pool_async moves GPU KV; the engine's KV is on {geom.device}")
    checked = check_pool_objects(geom, objects, block_ids, direction, chunk_size, skip_prefix_blocks)
    return _submit(geom, objects, checked, direction is Direction.D2H, chunk_size, skip_prefix_blocks, None, None, lead)


def lead_pool_retrieve(
    geom: KVGeometry,
    host: int,
    object_bytes: int,
    rows: int,
    n_objects: int,
    following: Callable[[int], Sequence[int]] | None = None,
) -> LeadDMA | None:
    """Start the first DMA of a GPU retrieve of `n_objects` whole pool objects (`object_bytes`, `rows` rows each)
    from the first one's pinned address, before the request is known whole (`TransferEngine.lead`): pass it to
    the request's `transfer_pool_async` / `transfer_async` (`lead=`), or `release()` it. None where the request
    would not start with such a DMA. `following(k)`: the addresses of up to `k` of the request's next objects,
    where its first slice joins several (those back to back with the first go in the same DMA). Its caller keeps
    the objects it named from being freed until the request has run."""
    engine: TransferEngine = _gpu_engine().default_engine(geom.device, _gpu_config)
    return engine.lead(host, object_bytes, rows, n_objects, following)


def transfer_pool_at_async(
    geom: KVGeometry,
    addresses: list[int],
    block_ids: BlockIds,
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
    last_tokens: int | None = None,
) -> TransferHandle:
    """`transfer_pool_async` for objects by address in one pinned slab with this geometry's object shape and dtype
    (just reserved in a `HostPool`, the caller carving their views after this returns: what a GPU store enqueues
    before anything else; or in a mapping of a server's shared pool): `check_pool_addresses` checks only the block
    ids. ``last_tokens``: the last object holds that many tokens (a tail's object), the others ``chunk_size``."""
    if geom.device.type != "cuda":
        raise ValueError(f"transfer_pool_at_async moves GPU KV; the engine's KV is on {geom.device}")
    checked = check_pool_addresses(geom, addresses, block_ids, direction, chunk_size, skip_prefix_blocks, last_tokens)
    return _submit(geom, addresses, checked, direction is Direction.D2H, chunk_size, skip_prefix_blocks, None, None)


def _submit(
    geom: KVGeometry,
    objs: list[torch.Tensor] | torch.Tensor | list[int],
    checked: Checked,
    to_objects: bool,
    chunk_size: int,
    skip: int,
    engine: TransferEngine | None,
    mode: str | None,
    lead: LeadDMA | None = None,
) -> TransferHandle:
    engine = engine or _gpu_engine().default_engine(geom.device, _gpu_config)
    return engine.submit(_plans.triton(geom), objs, checked, to_objects, chunk_size, skip, mode, ordering_event(), lead)


@functools.cache
def _gpu_engine() -> Any:
    """The GPU engine module, imported on first use (it imports Triton) and then found in ~0.1 us: an import
    statement in the request path costs ~1 us per call."""
    from kvferry.transfer import gpu_engine

    return gpu_engine


_gpu_config: EngineConfig | None = None  # of the default engines (configure_gpu); None: EngineConfig()


def configure_gpu(**settings: Any) -> None:
    """Settings (`EngineConfig` fields) of the GPU engines that `transfer` and `transfer_async` use when given none,
    process-wide, for the requests that follow. `kvferry.config.TransferConfig.engine_settings()` gives them from a
    config file; a `CacheEngine` applies its config's `transfer` section when it is made."""
    global _gpu_config
    from kvferry.transfer.engine_config import EngineConfig

    _gpu_config = EngineConfig(**settings)  # a bad name or value fails here, not on the first transfer


def _direction(direction: Direction | int | str) -> Direction:
    if type(direction) is Direction:
        return direction
    if isinstance(direction, str):
        try:
            return Direction[direction.upper()]
        except KeyError:
            raise ValueError(f"direction={direction!r} must be 'D2H' (store) or 'H2D' (retrieve)") from None
    try:
        return Direction(direction)
    except ValueError:
        raise ValueError(f"direction={direction!r} must be Direction.D2H or Direction.H2D") from None


def _backend(backend: str, geom: KVGeometry, objects: list[torch.Tensor] | torch.Tensor, checked: Checked) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if geom.device.type == "cuda" else "torch"
    if backend == "triton" and geom.device.type == "cuda" and checked.on_host:
        check_pinned(objects, checked)
        return backend
    devices = {objects.device} if isinstance(objects, torch.Tensor) else {o.device for o in objects}
    if devices != {geom.device}:
        if backend == "triton" and geom.device.type == "cuda":
            why = "a GPU engine needs all objects in pinned host memory or all on its device"
        elif backend == "triton":
            why = "on CPU tensors the triton backend (interpreter) needs objects on the CPU too"
        else:
            why = f"backend={backend!r} needs objects on the engine's device"
        raise ValueError(f"{why}: engine on {geom.device}, objects on {sorted(map(str, devices))}")
    return backend


class _PlanCache:
    """Backend plans per geometry, so a repeated request pays no re-derivation.

    Held weakly by geometry identity, and for the GPU also by layout (format, block size, dtype, and the address,
    shape and strides of every engine tensor) in a small LRU: a caller that passes no `geometry` gets a new one
    from `describe` on every call, and building a GPU plan derives its tables on the host and uploads them (on a
    stream of their own: a first request does not wait for the model's queued work). A plan keeps only its first
    engine tensor alive, so an address in the key cannot be reused by another allocation while the plan is
    cached; up to `LAYOUTS` such tensors are held.
    """

    LAYOUTS = 8

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[KVGeometry, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._by_layout: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def torch(self, geom: KVGeometry) -> Any:
        return self._cached(geom, "torch") or self._get(geom, "torch", self._build_torch)

    def triton(self, geom: KVGeometry) -> Any:
        return self._cached(geom, "triton") or self._get(geom, "triton", self._build_triton)

    def _cached(self, geom: KVGeometry, name: str) -> Any:
        """The plan if built already (every call after the first: no lock, no allocation)."""
        plans = self._plans.get(geom)
        return plans.get(name) if plans is not None else None

    def _get(self, geom: KVGeometry, name: str, build: Any) -> Any:
        with self._lock:
            plans = self._plans.setdefault(geom, {})
            if name not in plans:
                plans[name] = build(geom)
            return plans[name]

    @staticmethod
    def _build_torch(geom: KVGeometry) -> Any:
        from kvferry.kernels.torch_copy import build_plan

        return build_plan(geom)

    def forget(self, geom: KVGeometry) -> None:
        """Drop the plans of ``geom``'s tensors: the layout cache would otherwise keep one of them alive, and with it
        all of their memory (for KV mapped from another process, that process's GPU memory, held open)."""
        with self._lock:
            self._plans.pop(geom, None)
            if geom.device.type == "cuda":
                self._by_layout.pop(self._layout_key(geom), None)

    @staticmethod
    def _layout_key(geom: KVGeometry) -> tuple[Any, ...]:
        tensors = {id(t): t for s in geom.stripes for t in s.tensors}.values()
        views = tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in tensors)
        return (geom.fmt, geom.bs, geom.dtype, geom.first_head, geom.total_heads, geom.codec, views)

    def _build_triton(self, geom: KVGeometry) -> Any:
        from kvferry.kernels.triton_plan import build_plan

        if geom.device.type != "cuda":
            return build_plan(geom)
        key = self._layout_key(geom)
        plan = self._by_layout.get(key)  # called with the lock held
        if plan is None:
            plan = self._by_layout[key] = build_plan(geom)
            if len(self._by_layout) > self.LAYOUTS:
                self._by_layout.popitem(last=False)
        self._by_layout.move_to_end(key)
        return plan


_plans = _PlanCache()
_geometries = GeometryCache()
