"""Page DMA: the copy engine moves the engine's pages straight to and from chunk objects, with no kernel at all.

In a token-major layout (vLLM's FlashAttention `[NB, BS, H, D]` per layer and plane, its cross-layer `[NB, L, 2,
BS, H, D]`, FlashMLA's `[NB, BS, 576]`) each (plane, layer, block) page is `BS` whole token rows back to back, and
so is its place in a chunk object (`[planes, NL, tokens, W]`): a page is one contiguous run on both sides. A request
is then a list of copies, one per page (neighbouring blocks of one object merged where the engine's pages of
consecutive blocks are adjacent), which the driver takes as one batch (`cuMemcpyBatchAsync`). No staging slot, no
gather or scatter, and no SM time. It is what vLLM's own CPU offload does, and why the engine's "auto" mode does not
pick it: the driver spends about a microsecond of CPU per copy before the batch runs, so 16 scattered llama3-8b
chunks (16384 pages of 32 KiB) moved at 0.44-0.61 of a pinned memcpy and 16 DeepSeek MLA chunks at 0.61-0.73,
against 0.94-0.98 staged (H200; docs/gpu_data_path.md, "Page DMA"). `TransferEngine` runs it when asked
(`mode="page_dma"`), and `kvferry bench gpu-transfer` / `vllm-gpu` show it beside the staged path.

The copies are computed with numpy from a per-geometry `PagePlan` (block 0's page address and object row of each
(plane, layer) entry), so a request's Python cost does not grow with its page count. Layouts whose page is not a
run of whole rows (a head-major block, AMX tiles, a tensor-parallel rank's slice of each row, compressed objects)
have no page plan and keep the staged path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvferry.formats import KVGeometry
from kvferry.formats.geometry import Feature


@dataclass(frozen=True)
class PagePlan:
    """Where each (plane, layer) entry's pages are; built once per geometry (`page_plan`)."""

    dev: np.ndarray  # uint64 [E, 1]: the engine address of block 0's page of each entry
    rows: np.ndarray  # uint64 [E, 1]: the object row (plane * NL + layer) each entry fills
    block_stride: int  # bytes from one block's page to the next block's
    page: int  # bytes of one page: BS token rows
    bs: int
    row_bytes: int  # bytes of one token row (an object row's, which is the engine's here)

    @property
    def adjacent(self) -> bool:
        """Whether consecutive blocks' pages touch (then a run of consecutive block ids is one copy)."""
        return self.block_stride == self.page


def _row_major(features: Sequence[Feature], width: int) -> bool:
    """Whether the features walk `width` elements one after another (innermost stride 1, each outer stride the
    size of what is inside it)."""
    expect = 1
    for size, stride in reversed(features):
        if size > 1 and stride != expect:
            return False
        expect *= size
    return expect == width


def page_plan(geom: KVGeometry) -> PagePlan | None:
    """The geometry's pages as copies, or None where a page is not one run of whole object rows."""
    if geom.codec is not None or geom.partial_heads:
        return None
    es = geom.element_size
    devs: list[int] = []
    rows: list[int] = []
    strides = set()
    for s in geom.stripes:
        tiled = s.token_tile != geom.bs or s.tile_stride != 0
        if s.w_offset != 0 or s.width != geom.width or tiled or s.token_stride != geom.width:
            return None
        if not _row_major(s.features, geom.width):
            return None
        strides.add(s.block_stride * es)
        for tensor, offset, plane, layer in zip(s.tensors, s.offsets, s.planes, s.layers, strict=True):
            devs.append(tensor.data_ptr() + offset * es)
            rows.append(plane * geom.nl + layer)
    if len(strides) != 1 or not devs:
        return None
    row_bytes = geom.width * es
    return PagePlan(
        dev=np.array(devs, dtype=np.uint64)[:, None],
        rows=np.array(rows, dtype=np.uint64)[:, None],
        block_stride=strides.pop(),
        page=geom.bs * row_bytes,
        bs=geom.bs,
        row_bytes=row_bytes,
    )


def page_copies(
    plan: PagePlan,
    ids: np.ndarray | Sequence[int],
    ptrs: Sequence[int],
    caps: Sequence[int],
    chunk_size: int,
    skip: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(engine addresses, object addresses, byte counts), uint64 each, of a validated request's copies: block id
    `ids[k]` holds tokens `k*BS ..` of the request, object `o` the tokens of entries `o*chunk/BS ..` (capacity
    `caps[o]` tokens), the first `skip` entries not copied."""
    per_chunk = chunk_size // plan.bs
    blocks = np.asarray(ids, dtype=np.uint64)[skip:]
    k = np.arange(skip, skip + len(blocks), dtype=np.int64)
    obj = k // per_chunk
    if plan.adjacent and len(blocks) > 1:  # runs of consecutive block ids in one object: one copy each
        starts = np.flatnonzero(np.r_[True, (np.diff(blocks.astype(np.int64)) != 1) | (np.diff(obj) != 0)])
        counts = np.diff(np.r_[starts, len(blocks)]).astype(np.uint64)
        blocks, k, obj = blocks[starts], k[starts], obj[starts]
    else:
        counts = np.ones(len(blocks), dtype=np.uint64)
    token = ((k % per_chunk) * plan.bs).astype(np.uint64)
    ptr = np.asarray(ptrs, dtype=np.uint64)[obj]
    cap = np.asarray(caps, dtype=np.uint64)[obj]
    dev = plan.dev + blocks * np.uint64(plan.block_stride)
    host = ptr + (plan.rows * cap + token) * np.uint64(plan.row_bytes)
    sizes = np.broadcast_to(counts * np.uint64(plan.page), dev.shape)
    return dev.ravel(), host.ravel(), np.ascontiguousarray(sizes).ravel()
