"""`kvferry.transfer`: the seed's multi_layer_block_kv_transfer, one contract over three backends."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import torch

from kvferry.formats import EngineKVFormat, KVGeometry, describe
from kvferry.transfer.pinned import is_known_pinned

if TYPE_CHECKING:
    from kvferry.transfer.gpu_engine import TransferEngine, TransferHandle

Backend = Literal["auto", "reference", "torch", "triton"]
BACKENDS = ("auto", "reference", "torch", "triton")


class Direction(IntEnum):
    """H2D = retrieve (objects -> engine), D2H = store (engine -> objects); the seed's TransferDirection."""

    H2D = 0
    D2H = 1


def transfer(
    paged: Any,
    objects: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
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
    Pass `geometry` (from `kvferry.formats.describe`) to skip re-validating the engine tensors on every call.
    """
    geom = geometry if geometry is not None else describe(fmt, paged, block_size)
    if geometry is not None and EngineKVFormat(fmt) != geom.fmt:
        raise ValueError(f"fmt={EngineKVFormat(fmt).name} but the geometry describes {geom.fmt.name}")
    direction = _direction(direction)
    objs = list(objects)
    checked = _check(geom, objs, block_ids, direction, chunk_size, skip_prefix_blocks)
    chosen = _backend(backend, geom, objs, checked)
    to_objects = direction is Direction.D2H
    ids = torch.from_numpy(checked.ids)
    if chosen == "reference":
        from kvferry.kernels.reference import copy_reference

        copy_reference(geom, paged, objs, checked.ids.tolist(), to_objects, chunk_size, skip_prefix_blocks)
    elif chosen == "torch":
        from kvferry.kernels.torch_copy import copy_torch

        copy_torch(_plans.torch(geom), objs, ids.to(geom.device), to_objects, chunk_size, skip_prefix_blocks)
    elif geom.device.type == "cuda" and checked.on_host:
        _submit(geom, objs, checked, to_objects, chunk_size, skip_prefix_blocks, None, None).wait()
    else:
        from kvferry.kernels.triton_copy import copy_triton

        copy_triton(_plans.triton(geom), objs, ids.to(geom.device), to_objects, chunk_size, skip_prefix_blocks)
        if geom.device.type == "cuda":
            torch.cuda.current_stream(geom.device).synchronize()


def transfer_async(
    paged: Any,
    objects: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    direction: Direction,
    fmt: EngineKVFormat | int,
    chunk_size: int = 256,
    skip_prefix_blocks: int = 0,
    block_size: int | None = None,
    geometry: KVGeometry | None = None,
    engine: TransferEngine | None = None,
    mode: str | None = None,
) -> TransferHandle:
    """Enqueue a transfer between GPU blocks and pinned host objects; returns at once with a handle.

    The request is ordered after the caller's current CUDA stream (the engine's compute) and never blocks it.
    Use `handle.wait_on(stream)` before the engine reads retrieved blocks, `handle.done()` to poll.
    """
    geom = geometry if geometry is not None else describe(fmt, paged, block_size)
    if geom.device.type != "cuda":
        raise ValueError(f"transfer_async moves GPU KV; the engine's KV is on {geom.device} (use transfer())")
    objs = list(objects)
    direction = _direction(direction)
    checked = _check(geom, objs, block_ids, direction, chunk_size, skip_prefix_blocks)
    if not checked.on_host:
        raise ValueError("transfer_async needs chunk objects in pinned host memory")
    _backend("triton", geom, objs, checked)
    return _submit(geom, objs, checked, direction is Direction.D2H, chunk_size, skip_prefix_blocks, engine, mode)


def _submit(
    geom: KVGeometry,
    objs: list[torch.Tensor],
    checked: Checked,
    to_objects: bool,
    chunk_size: int,
    skip: int,
    engine: TransferEngine | None,
    mode: str | None,
) -> TransferHandle:
    from kvferry.transfer.gpu_engine import default_engine

    engine = engine or default_engine(geom.device)
    return engine.submit(_plans.triton(geom), objs, checked, to_objects, chunk_size, skip, mode)


class Checked(NamedTuple):
    """A validated request: its block ids (a private int64 copy) and what the GPU path reads off each object."""

    ids: np.ndarray
    ptrs: list[int]  # each object's address
    caps: list[int]  # each object's token capacity
    on_host: bool  # every object is in CPU (host) memory


def check_request(
    geom: KVGeometry,
    objects: list[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> torch.Tensor:
    """Validate a request against the geometry; return the block ids as a CPU int64 tensor."""
    return torch.from_numpy(_check(geom, objects, block_ids, direction, chunk_size, skip_prefix_blocks).ids)


# Below this many ids, range and repeat checks run on a Python list (a numpy reduction costs ~1.5 us however small).
_SMALL_IDS = 128


def _check(
    geom: KVGeometry,
    objects: list[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> Checked:
    """`check_request`, keeping what the GPU path needs of every object (one pass of attribute reads)."""
    bs = geom.bs
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % bs:
        raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of the block size {bs}")
    if not objects:
        raise ValueError("objects is empty: pass at least one chunk object")
    want = geom.object_shape(chunk_size)
    full = (want[0], want[1], chunk_size, want[3])
    dtype = geom.dtype
    ptrs = []
    on_host = True
    last_index = len(objects) - 1
    for i, obj in enumerate(objects):  # attribute reads only: ~0.5 us per object
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"objects[{i}] must be a torch.Tensor, got {type(obj).__name__}")
        shape = obj.shape
        if shape != full and not (i == last_index and _partial_ok(shape, want, chunk_size, bs)):
            hint = " (only the last object may be partial, a multiple of BS tokens)" if i < last_index else ""
            raise ValueError(f"objects[{i}] has shape {tuple(shape)}, expected {want}{hint}")
        if obj.dtype != dtype:
            raise TypeError(f"objects[{i}] has dtype {obj.dtype}; the engine's KV is {dtype}")
        if not obj.is_contiguous():
            raise ValueError(f"objects[{i}] must be contiguous")
        ptrs.append(obj.data_ptr())
        on_host = on_host and obj.is_cpu
    caps = [chunk_size] * last_index + [objects[-1].shape[2]]  # only the last may be partial (checked above)
    ids = _as_id_array(block_ids)
    if len(ids) != sum(caps) // bs:
        raise ValueError(
            f"block_ids has {len(ids)} entries but the {len(objects)} objects hold {sum(caps) // bs} blocks "
            f"({sum(caps)} tokens / block size {bs})"
        )
    if not 0 <= skip_prefix_blocks <= len(ids):
        raise ValueError(f"skip_prefix_blocks={skip_prefix_blocks} must be within 0..{len(ids)}")
    copied = ids[skip_prefix_blocks:]
    if len(copied):
        small = copied.tolist() if len(copied) < _SMALL_IDS else None
        lo, hi = (min(small), max(small)) if small is not None else (copied.min(), copied.max())
        if lo < 0 or hi >= geom.nb:
            bad = int(np.flatnonzero((copied < 0) | (copied >= geom.nb))[0]) + skip_prefix_blocks
            raise ValueError(f"block_ids[{bad}]={int(ids[bad])} is outside the pool of {geom.nb} blocks")
        if direction is Direction.H2D and len(copied) > 1 and _repeats(copied, small):
            raise ValueError("block_ids repeats a block: a retrieve would write one block from two places")
    return Checked(ids, ptrs, caps, on_host)


def _repeats(ids: np.ndarray, small: list[int] | None) -> bool:
    if small is not None:
        return len(set(small)) != len(small)
    ordered = np.sort(ids)  # a repeat sits next to itself once sorted (np.unique costs twice this)
    return bool((ordered[1:] == ordered[:-1]).any())


def _partial_ok(shape: torch.Size, want: tuple[int, int, int, int], chunk_size: int, bs: int) -> bool:
    return (
        len(shape) == 4
        and (shape[0], shape[1], shape[3]) == (want[0], want[1], want[3])
        and 0 < shape[2] < chunk_size
        and shape[2] % bs == 0
    )


def _as_id_array(block_ids: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype is torch.int64 and block_ids.is_cpu and block_ids.dim() == 1:  # the common case, fast
            return block_ids.numpy().copy()
        if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
            raise TypeError(f"block_ids must hold integers, got dtype {block_ids.dtype}")
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
        if block_ids.dtype != torch.int64 or block_ids.device.type != "cpu":
            block_ids = block_ids.to(device="cpu", dtype=torch.int64)
        return block_ids.numpy().copy()  # a private copy: what was validated is what moves
    try:
        ids = np.asarray(block_ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"block_ids must be a sequence of ints or an int tensor: {exc}") from None
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {ids.shape}")
    return ids


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


def _backend(backend: str, geom: KVGeometry, objects: list[torch.Tensor], checked: Checked) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if geom.device.type == "cuda" else "torch"
    if backend == "triton" and geom.device.type == "cuda" and checked.on_host:
        _check_pinned(objects, checked.ptrs)
        return backend
    devices = {o.device for o in objects}
    if devices != {geom.device}:
        if backend == "triton" and geom.device.type == "cuda":
            why = "a GPU engine needs all objects in pinned host memory or all on its device"
        elif backend == "triton":
            why = "on CPU tensors the triton backend (interpreter) needs objects on the CPU too"
        else:
            why = f"backend={backend!r} needs objects on the engine's device"
        raise ValueError(f"{why}: engine on {geom.device}, objects on {sorted(map(str, devices))}")
    return backend


def _check_pinned(objects: list[torch.Tensor], ptrs: list[int]) -> None:
    """Host objects for a GPU kernel or DMA must be pinned: one range check when they share a registered slab
    (the pool's objects), else a CUDA query per allocation."""
    top = ptrs.index(max(ptrs))
    if is_known_pinned(min(ptrs), ptrs[top] + objects[top].nbytes):
        return
    asked: set[int] = set()  # pinned-ness is a property of the allocation: ask once per storage
    for i, o in enumerate(objects):
        if is_known_pinned(ptrs[i]):
            continue
        storage = o.untyped_storage().data_ptr()
        if storage not in asked and not o.is_pinned():
            raise ValueError(f"objects[{i}] is pageable host memory; a GPU kernel needs pinned or device memory")
        asked.add(storage)


class _PlanCache:
    """Backend plans per geometry, so a repeated request pays no re-derivation.

    Held weakly by geometry identity, and for the GPU also by layout (format, block size, dtype, and the address,
    shape and strides of every engine tensor) in a small LRU: a caller that passes no `geometry` gets a new one
    from `describe` on every call, and building a GPU plan uploads its tables with a copy that waits for the
    caller's stream, i.e. for the model. A plan keeps only its first engine tensor alive, so an address in the
    key cannot be reused by another allocation while the plan is cached; up to `LAYOUTS` such tensors are held.
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

    def _build_triton(self, geom: KVGeometry) -> Any:
        from kvferry.kernels.triton_copy import build_plan

        if geom.device.type != "cuda":
            return build_plan(geom)
        tensors = {id(t): t for s in geom.stripes for t in s.tensors}.values()
        key = (geom.fmt, geom.bs, geom.dtype, tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in tensors))
        plan = self._by_layout.get(key)  # called with the lock held
        if plan is None:
            plan = self._by_layout[key] = build_plan(geom)
            if len(self._by_layout) > self.LAYOUTS:
                self._by_layout.popitem(last=False)
        self._by_layout.move_to_end(key)
        return plan


_plans = _PlanCache()
