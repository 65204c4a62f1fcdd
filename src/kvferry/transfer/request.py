"""What a transfer request is, and its validation: everything is checked before a byte moves.

Objects come as a list of chunk-object tensors, or as one tensor `[n, *object_shape]` holding `n` whole objects
back to back (what `HostPool.try_alloc_many` carves for a request): one shape/dtype/contiguity check for all of
them, their addresses by arithmetic, and one DMA per slice on the GPU path. With 32 small objects the per-object
checks of a list were most of a request's CPU time before its first GPU operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch

from kvferry.cuda.pinned import is_known_pinned
from kvferry.formats import KVGeometry
from kvferry.transfer.block_ids import BlockIds, CheckedBlockIds, PendingBlockIds, check_block_ids

Objects = Sequence[torch.Tensor] | torch.Tensor


class Direction(IntEnum):
    """H2D = retrieve (objects -> engine), D2H = store (engine -> objects); the seed's TransferDirection."""

    H2D = 0
    D2H = 1


class Checked(NamedTuple):
    """A validated request: its block ids (private int64) and what the GPU path reads off each object."""

    # int64, not to be written (the ids checked, or a view of a `CheckedBlockIds`'s); pending: the engine checks
    # them once its first copies into staging are in flight (`check_pool_addresses`)
    ids: np.ndarray | PendingBlockIds[np.ndarray]
    ptrs: list[int]  # each object's address
    caps: list[int]  # each object's token capacity
    rows: int  # object rows: planes x layers
    on_host: bool  # every object is in CPU (host) memory
    one_run: bool  # the objects were given as one tensor: back to back in one allocation
    in_pinned_slab: bool  # they all lie in one registered pinned slab (the pool's): pinned, and one allocation

    @property
    def one_allocation(self) -> bool:
        """Objects back to back in memory may share a DMA: they are one allocation."""
        return self.one_run or self.in_pinned_slab


def as_objects(objects: Objects) -> list[torch.Tensor] | torch.Tensor:
    """A caller's objects as the checks take them: one tensor stays one tensor, anything else becomes a list."""
    return objects if isinstance(objects, torch.Tensor) else list(objects)


def object_list(objects: list[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """One tensor per object (for the backends that walk objects one by one)."""
    return list(objects.unbind(0)) if isinstance(objects, torch.Tensor) else objects


def check_request(
    geom: KVGeometry,
    objects: Objects,
    block_ids: BlockIds,
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> torch.Tensor:
    """Validate a request against the geometry; return the block ids as a CPU int64 tensor."""
    objs = as_objects(objects)
    return torch.from_numpy(check(geom, objs, block_ids, direction, chunk_size, skip_prefix_blocks).ids)


def check(
    geom: KVGeometry,
    objects: list[torch.Tensor] | torch.Tensor,
    block_ids: BlockIds,
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> Checked:
    """`check_request`, keeping what the GPU path needs of every object (one pass of attribute reads).

    A one-chunk request's whole check is on the path to its first GPU operation: the per-object test is one
    expression, and only a failing object is looked at again (`_explain`) to say what is wrong with it."""
    bs = geom.bs
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % bs:
        raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of the block size {bs}")
    want = geom.object_shape(chunk_size)
    if isinstance(objects, torch.Tensor):
        ptrs, caps, on_host = _check_run(objects, want, geom.object_dtype)
        n_blocks = len(caps) * (chunk_size // bs)
        first, end = ptrs[0], ptrs[0] + objects.nbytes
    else:
        ptrs, caps, on_host = _check_list(objects, want, geom.object_dtype, chunk_size, bs)
        n_blocks = sum(caps) // bs
        first = min(ptrs)
        top = max(ptrs)
        end = top + objects[ptrs.index(top)].nbytes
    if geom.codec is not None and any(p % 4 for p in ptrs):
        raise ValueError("compressed chunk objects must be 4-byte aligned (their float32 scales)")
    in_pinned_slab = on_host and is_known_pinned(first, end)  # one range lookup for all of them
    ids = _checked_ids(geom, block_ids, n_blocks, len(caps), direction, skip_prefix_blocks)
    return Checked(ids, ptrs, caps, want[0] * want[1], on_host, isinstance(objects, torch.Tensor), in_pinned_slab)


def check_pool_objects(
    geom: KVGeometry,
    objects: list[torch.Tensor],
    block_ids: BlockIds | PendingBlockIds[CheckedBlockIds],
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> Checked:
    """`check` for whole chunk objects the caller carved from one pinned `HostPool` (the cache's own). The pool's
    views are contiguous and lie in its pinned slab by construction, so only what could still be wrong is checked:
    each object's shape and dtype (an object promoted from a tier was shaped by the tier's header) and the block
    ids (not again when the cache checked them: `CheckedBlockIds`; later, by the engine, when they are pending:
    `PendingBlockIds`). A one-chunk retrieve's check is on the path to its first GPU operation: this is about half
    of `check`."""
    bs = geom.bs
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % bs:
        raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of the block size {bs}")
    want, dtype = geom.object_shape(chunk_size), geom.object_dtype
    ptrs = []
    for i, obj in enumerate(objects):
        if obj.shape != want or obj.dtype != dtype:
            raise ValueError(f"objects[{i}] is {tuple(obj.shape)} {obj.dtype}; expected whole objects {want} {dtype}")
        ptrs.append(obj.data_ptr())
    if not ptrs:
        raise ValueError("objects is empty: pass at least one chunk object")
    return check_pool_addresses(geom, ptrs, block_ids, direction, chunk_size, skip_prefix_blocks)


def check_pool_addresses(
    geom: KVGeometry,
    addresses: list[int],
    block_ids: BlockIds | PendingBlockIds[CheckedBlockIds],
    direction: Direction,
    chunk_size: int,
    skip_prefix_blocks: int,
    last_tokens: int | None = None,
) -> Checked:
    """`check_pool_objects` for whole objects given by address, reserved in one pinned slab for this geometry's
    object shape and dtype (`HostPool.try_reserve_many`, or a mapping of a server's shared pool): only the block ids
    are left to check (nothing, when they come checked: `CheckedBlockIds`). ``last_tokens``: the last object is a
    partial one of that many tokens (a tail's object)."""
    bs = geom.bs
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % bs:
        raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of the block size {bs}")
    if not addresses:
        raise ValueError("addresses is empty: pass at least one chunk object")
    n = len(addresses)
    caps = [chunk_size] * n
    if last_tokens is not None:
        if not 0 < last_tokens <= chunk_size or last_tokens % bs:
            raise ValueError(f"last_tokens={last_tokens} must be a multiple of {bs} within 1..{chunk_size}")
        caps[-1] = last_tokens
    n_blocks = (n - 1) * (chunk_size // bs) + caps[-1] // bs
    ids: np.ndarray | PendingBlockIds[np.ndarray]
    if isinstance(block_ids, PendingBlockIds):
        ids = _pending_ids(geom, block_ids, n_blocks, n, direction, skip_prefix_blocks)
    else:
        ids = _checked_ids(geom, block_ids, n_blocks, n, direction, skip_prefix_blocks)
    want = geom.object_shape(chunk_size)
    return Checked(ids, list(addresses), caps, want[0] * want[1], True, False, True)


def _pending_ids(
    geom: KVGeometry,
    pending: PendingBlockIds[CheckedBlockIds],
    n_blocks: int,
    n_objects: int,
    direction: Direction,
    skip_prefix_blocks: int,
) -> PendingBlockIds[np.ndarray]:
    """`_checked_ids` run by the engine when it asks (`PendingBlockIds`); what needs no ids is checked now."""
    if not 0 <= skip_prefix_blocks <= n_blocks:
        raise ValueError(f"skip_prefix_blocks={skip_prefix_blocks} must be within 0..{n_blocks}")
    if pending.count != n_blocks:
        raise ValueError(f"{pending.count} pending block ids for {n_objects} objects of {n_blocks} blocks")
    return PendingBlockIds(
        n_blocks, lambda: _checked_ids(geom, pending.check(), n_blocks, n_objects, direction, skip_prefix_blocks)
    )


def _checked_ids(
    geom: KVGeometry,
    block_ids: BlockIds,
    n_blocks: int,
    n_objects: int,
    direction: Direction,
    skip_prefix_blocks: int,
) -> np.ndarray:
    """The block ids as a private int64 array, checked (`check_block_ids`): one per block the objects hold, in the
    pool's range, and no block written twice by a retrieve. Ids checked already (`CheckedBlockIds`) that cover
    this request are taken as they are."""
    if not 0 <= skip_prefix_blocks <= n_blocks:
        raise ValueError(f"skip_prefix_blocks={skip_prefix_blocks} must be within 0..{n_blocks}")
    distinct = direction is Direction.H2D  # a retrieve writes each block once
    if (
        type(block_ids) is CheckedBlockIds
        and len(block_ids.ids) == n_blocks
        and block_ids.covers(geom.nb, skip_prefix_blocks, distinct)
    ):
        return block_ids.ids
    return check_block_ids(
        block_ids, geom.nb, geom.bs, needed=n_blocks, start=skip_prefix_blocks, distinct=distinct, objects=n_objects
    ).ids


def _check_list(
    objects: list[torch.Tensor],
    want: tuple[int, int, int, int],
    dtype: torch.dtype,
    chunk_size: int,
    bs: int,
) -> tuple[list[int], list[int], bool]:
    if not objects:
        raise ValueError("objects is empty: pass at least one chunk object")
    ptrs: list[int] = []
    on_host = True
    for obj in objects:  # attribute reads only: ~0.5 us per object; a failure is explained below
        if type(obj) is not torch.Tensor or obj.shape != want or obj.dtype != dtype or not obj.is_contiguous():
            _explain(objects, len(ptrs), want, dtype, chunk_size, bs)  # raises, unless a partial last object
        ptrs.append(obj.data_ptr())
        on_host = on_host and obj.is_cpu
    caps = [chunk_size] * len(objects)
    if objects[-1].shape[2] != chunk_size:
        caps[-1] = objects[-1].shape[2]
    return ptrs, caps, on_host


def _explain(
    objects: list[torch.Tensor], i: int, want: tuple[int, int, int, int], dtype: torch.dtype, chunk_size: int, bs: int
) -> None:
    """Raise the error that ``objects[i]`` deserves; return if it is fine after all (a partial last object, or a
    tensor subclass)."""
    obj, last = objects[i], len(objects) - 1
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"objects[{i}] must be a torch.Tensor, got {type(obj).__name__}")
    shape = obj.shape
    if shape != want and not (i == last and _partial_ok(shape, want, chunk_size, bs)):
        hint = " (only the last object may be partial, a multiple of BS tokens)" if i < last else ""
        raise ValueError(f"objects[{i}] has shape {tuple(shape)}, expected {want}{hint}")
    if obj.dtype != dtype:
        raise TypeError(f"objects[{i}] has dtype {obj.dtype}; this engine's chunk objects are {dtype}")
    if not obj.is_contiguous():
        raise ValueError(f"objects[{i}] must be contiguous")


def _check_run(
    objects: torch.Tensor, full: tuple[int, int, int, int], dtype: torch.dtype
) -> tuple[list[int], list[int], bool]:
    """`n` whole objects as one tensor `[n, *object_shape]`."""
    if objects.dim() != 5 or tuple(objects.shape[1:]) != full or objects.shape[0] == 0:
        raise ValueError(
            f"objects given as one tensor must be [n >= 1, {', '.join(map(str, full))}] (n whole objects), "
            f"got shape {tuple(objects.shape)}"
        )
    if objects.dtype != dtype:
        raise TypeError(f"objects has dtype {objects.dtype}; this engine's chunk objects are {dtype}")
    if not objects.is_contiguous():
        raise ValueError("objects given as one tensor must be contiguous")
    size = objects.stride(0) * objects.element_size()
    base = objects.data_ptr()
    n = objects.shape[0]
    return list(range(base, base + n * size, size)), [full[2]] * n, objects.is_cpu


def _partial_ok(shape: torch.Size, want: tuple[int, int, int, int], chunk_size: int, bs: int) -> bool:
    return (
        len(shape) == 4
        and (shape[0], shape[1], shape[3]) == (want[0], want[1], want[3])
        and 0 < shape[2] < chunk_size
        and shape[2] % bs == 0
    )


def check_pinned(objects: list[torch.Tensor] | torch.Tensor, checked: Checked) -> None:
    """Host objects for a GPU kernel or DMA must be pinned: known at once for the pool's objects, else a CUDA
    query per allocation."""
    if checked.in_pinned_slab:
        return
    if isinstance(objects, torch.Tensor):
        if not objects.is_pinned():
            raise ValueError("objects is pageable host memory; a GPU kernel needs pinned or device memory")
        return
    asked: set[int] = set()  # pinned-ness is a property of the allocation: ask once per storage
    for i, o in enumerate(objects):
        if is_known_pinned(checked.ptrs[i]):
            continue
        storage = o.untyped_storage().data_ptr()
        if storage not in asked and not o.is_pinned():
            raise ValueError(f"objects[{i}] is pageable host memory; a GPU kernel needs pinned or device memory")
        asked.add(storage)
