"""How the cache's chunks move: one transfer per request, however the engine's KV and the pool are placed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvferry.formats import KVGeometry
from kvferry.memory import HostPool
from kvferry.transfer import Direction, transfer, transfer_async
from kvferry.transfer.api import transfer_pool_async
from kvferry.transfer.block_ids import CheckedBlockIds, PendingBlockIds

if TYPE_CHECKING:
    from kvferry.transfer.handle import TransferHandle
    from kvferry.transfer.lane import LeadDMA


def copy_chunks(
    pool: HostPool,
    chunk_size: int,
    paged: Any,
    geom: KVGeometry,
    objects: list[torch.Tensor],
    ids: CheckedBlockIds | PendingBlockIds[CheckedBlockIds],
    direction: Direction,
    skip: int,
    lead: LeadDMA | None = None,
) -> TransferHandle | None:
    """The one place the cache moves bytes: a GPU engine's transfer is returned in flight (its handle), anything
    else has moved when this returns (None). The last object may be a tail (fewer tokens, whole blocks). Pending
    ids are checked by the GPU engine after its first DMAs into staging, anywhere else first. `lead`: a GPU
    retrieve's first DMA, already started (`lead_pool_retrieve`); the caller releases it if this raises."""
    if _gpu_with_pinned_pool(geom, pool) and objects[-1].shape[2] == chunk_size:  # whole pool objects: lighter check
        return transfer_pool_async(geom, objects, ids, direction, chunk_size, skip, lead)
    if isinstance(ids, PendingBlockIds):
        ids = ids.check()
    if geom.device.type == "cuda" and objects[0].is_cpu:  # an unpinned pool: transfer_async explains
        return transfer_async(paged, objects, ids, direction, geom.fmt, chunk_size, skip, geometry=geom, lead=lead)
    if lead is not None:  # no GPU engine moves these: the lane goes back before the copy
        lead.release()
    transfer(paged, objects, ids, direction, geom.fmt, chunk_size, skip, geometry=geom)
    return None


def copies_in_background(geom: KVGeometry, pool: HostPool) -> bool:
    """Whether `copy_chunks` returns with the copy still running (a GPU engine and a pinned pool), so work done
    after enqueueing it overlaps it: the condition for storing ahead."""
    return _gpu_with_pinned_pool(geom, pool)


def _gpu_with_pinned_pool(geom: KVGeometry, pool: HostPool) -> bool:
    return geom.device.type == "cuda" and pool.is_pinned


def head_masks(geom: KVGeometry) -> tuple[int, int] | None:
    """(the engine's heads, every head) as bit masks when it holds a slice of the model's heads; else None."""
    if not geom.partial_heads:
        return None
    return ((1 << geom.nh) - 1) << geom.first_head, (1 << geom.total_heads) - 1
