"""Vectorised torch copy (the CPU path): one gather or scatter per (stripe, object), no loop per block or layer.

Each stripe's entries are folded into one strided view `[planes, layers, NB, BS, *features]` over the engine's
storage when they are evenly spaced in it (engines allocate their layers as views of one buffer). Stores gather with
`index_select(..., out=<object slice>)`; retrieves scatter with numpy fancy assignment on CPU (a copy loop per block
piece; torch's CPU index_copy_ is elementwise and ~3x slower), one object per thread, and `index_copy_` elsewhere.

On CPU, when every block piece is one contiguous run (token-major layouts: NHD, MLA, fused NHD) and the object slice
is contiguous, the engine storage is seen as a 2-D array of piece-sized rows: a store is one torch `index_select`
over those rows per object (a parallel memcpy per row), a retrieve is numpy's `rows[ids] = ...` (a memcpy per row)
with `torch.get_num_threads()` Python threads taking whole objects (numpy releases the GIL). torch has no fast row
scatter: its CPU `index_copy_`/`index_put_` copy element by element (~0.25 of memcpy). Numbers: BENCHMARKS.md.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvferry.formats import KVGeometry, Stripe

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIN_PART_BYTES = 1 << 20  # below this, a copy is not worth splitting across threads


@dataclass(frozen=True)
class _Rows:
    """Engine block pieces as rows of one C-contiguous 2-D array: piece (p, l, b) is row `base[p, l] + b * step`."""

    array: np.ndarray  # [rows, BS * width] words over the engine's whole storage (a view, no copy)
    base: np.ndarray  # int64 [P, L]
    step: int


@dataclass(frozen=True)
class _Block:
    """Evenly spaced stripe entries as one strided engine view, and where they go in an object."""

    view: torch.Tensor  # [P, L, NB, *tokens, *features], dtype = the word type of the element size
    tokens: tuple[int, ...]  # (BS,), or (BS / tile, tile) where the engine packs tokens in tiles
    planes: slice
    layers: slice
    w: slice
    rows: _Rows | None  # CPU engines whose block pieces are contiguous runs


@dataclass(frozen=True)
class TorchPlan:
    bs: int
    element_size: int
    device: torch.device
    blocks: tuple[_Block, ...]


def build_plan(geom: KVGeometry) -> TorchPlan:
    word = _WORD[geom.element_size]
    blocks: list[_Block] = []
    for stripe in geom.stripes:
        for members in _even_groups(stripe):
            blocks.append(_fold(geom, stripe, members, word))
    return TorchPlan(bs=geom.bs, element_size=geom.element_size, device=geom.device, blocks=tuple(blocks))


def copy_torch(
    plan: TorchPlan,
    objects: list[torch.Tensor],
    block_ids: torch.Tensor,
    to_objects: bool,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> None:
    word = _WORD[plan.element_size]
    per_object = chunk_size // plan.bs
    n = len(block_ids)
    ids_np = block_ids.numpy() if plan.device.type == "cpu" else None
    scatters: list[_Scatter] = []  # retrieves on CPU, run together at the end over threads
    for o, obj in enumerate(objects):
        j0, j1 = max(o * per_object, skip_prefix_blocks), min(o * per_object + obj.shape[2] // plan.bs, n)
        if j0 >= j1:
            continue
        tokens = slice((j0 - o * per_object) * plan.bs, (j1 - o * per_object) * plan.bs)
        obj_w = obj.view(word)
        for b in plan.blocks:
            piece = obj_w[b.planes, b.layers, tokens, b.w]
            if b.rows is not None and ids_np is not None and piece.is_contiguous():
                engine_rows = (b.rows.base[:, :, None] + ids_np[j0:j1][None, None, :] * b.rows.step).reshape(-1)
                object_rows = piece.numpy().reshape(len(engine_rows), b.rows.array.shape[1])
                if to_objects:
                    # One parallel memcpy loop over 2-D contiguous rows (torch's index_select): 0.8-0.9 of a
                    # same-run memcpy on a quiet 2-core machine; numpy's take is single-threaded (~0.6).
                    torch.index_select(
                        torch.from_numpy(b.rows.array),
                        0,
                        torch.from_numpy(engine_rows),
                        out=torch.from_numpy(object_rows),
                    )
                else:
                    scatters.append(_Scatter(b.rows.array, 0, engine_rows, object_rows))
                continue
            piece = piece.unflatten(2, (j1 - j0, *b.tokens)).unflatten(-1, b.view.shape[3 + len(b.tokens) :])
            if to_objects:
                torch.index_select(b.view, 2, block_ids[j0:j1], out=piece)
            elif ids_np is not None:
                scatters.append(_Scatter(b.view.numpy(), 2, ids_np[j0:j1], piece.numpy()))
            else:
                b.view.index_copy_(2, block_ids[j0:j1], piece)
    if scatters:
        _scatter(scatters)


class _Scatter(NamedTuple):
    """`array[..., index, ...] = values` with `index` on `axis`: one object's rows (axis 0 of the row array), or
    one object's blocks of a folded view (axis 2) where block pieces are not single runs (HND, transposed K)."""

    array: np.ndarray
    axis: int
    index: np.ndarray
    values: np.ndarray

    def run(self) -> None:
        self.array[(slice(None),) * self.axis + (self.index,)] = self.values

    def split(self, parts: int) -> list[_Scatter]:
        bounds = np.linspace(0, len(self.index), parts + 1, dtype=np.int64)
        at = (slice(None),) * self.axis
        return [self._replace(index=self.index[a:b], values=self.values[(*at, slice(a, b))])
                for a, b in itertools.pairwise(bounds)]  # fmt: skip


def _scatter(jobs: list[_Scatter]) -> None:
    """Every job, spread over threads (numpy releases the GIL).

    Threads take whole jobs (one object's piece each) and meet once at the end: splitting every object across
    the threads and waiting after each (0.6-0.7 of memcpy) idles a thread whenever its half runs slower; this
    reaches 0.8-1.0 for row jobs. A request of fewer objects than threads is cut into spans instead. Block jobs
    copy many short runs (a head's 256 bytes in HND layouts, 2-byte elements of a transposed K), which is CPU work
    more than memory traffic: two threads lift an HND retrieve from 0.44-0.48 to 0.68-0.72 of memcpy.
    """
    workers = min(torch.get_num_threads(), max(1, sum(job.values.nbytes for job in jobs) // _MIN_PART_BYTES))
    if len(jobs) < workers:
        jobs = [span for job in jobs for span in job.split(-(-workers // len(jobs)))]
    if workers == 1:
        for job in jobs:
            job.run()
    else:
        list(_pool(workers).map(_Scatter.run, jobs))


@functools.cache
def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvferry-copy")


# A forked child inherits the executors but not their threads: it must make its own.
os.register_at_fork(after_in_child=_pool.cache_clear)


def _even_groups(stripe: Stripe) -> list[list[int]]:
    """Split the stripe's entries into groups that form an evenly spaced (plane x layer) grid in one storage."""
    entries = list(range(len(stripe.planes)))
    whole = _grid(stripe, entries)
    if whole is not None:
        return [entries]
    groups = []
    for plane in sorted(set(stripe.planes)):
        members = [i for i in entries if stripe.planes[i] == plane]
        groups += [members] if _grid(stripe, members) is not None else [[i] for i in members]
    return groups


def _grid(stripe: Stripe, members: list[int]) -> tuple[int, int] | None:
    """(plane stride, layer stride) in storage elements if `members` is an evenly spaced full grid, else None."""
    storages = {stripe.tensors[i].untyped_storage().data_ptr() for i in members}
    if len(storages) != 1:
        return None
    planes = sorted({stripe.planes[i] for i in members})
    layers = sorted({stripe.layers[i] for i in members})
    if len(planes) * len(layers) != len(members) or not (_even(planes) and _even(layers)):
        return None
    where = {(stripe.planes[i], stripe.layers[i]): _storage_offset(stripe, i) for i in members}
    origin = where[(planes[0], layers[0])]
    sp = where[(planes[1], layers[0])] - origin if len(planes) > 1 else 0
    sl = where[(planes[0], layers[1])] - origin if len(layers) > 1 else 0
    for (p, layer), off in where.items():
        if off != origin + planes.index(p) * sp + layers.index(layer) * sl:
            return None
    return sp, sl


def _even(values: list[int]) -> bool:
    return len(values) < 2 or len({b - a for a, b in itertools.pairwise(values)}) == 1


def _storage_offset(stripe: Stripe, i: int) -> int:
    t = stripe.tensors[i]
    return t.storage_offset() + stripe.offsets[i]


def _fold(geom: KVGeometry, stripe: Stripe, members: list[int], word: torch.dtype) -> _Block:
    sp, sl = _grid(stripe, members) or (0, 0)
    planes = sorted({stripe.planes[i] for i in members})
    layers = sorted({stripe.layers[i] for i in members})
    first = min(members, key=lambda i: (stripe.planes[i], stripe.layers[i]))
    storage = stripe.tensors[first].untyped_storage()
    words = torch.empty(0, dtype=word, device=geom.device).set_(storage)
    if stripe.token_tile == geom.bs:
        tokens, token_strides = [geom.bs], [stripe.token_stride]
    else:
        tokens = [geom.bs // stripe.token_tile, stripe.token_tile]
        token_strides = [stripe.tile_stride, stripe.token_stride]
    sizes = [len(planes), len(layers), geom.nb, *tokens, *(n for n, _ in stripe.features)]
    strides = [sp, sl, stripe.block_stride, *token_strides, *(s for _, s in stripe.features)]
    view = words.as_strided(sizes, strides, _storage_offset(stripe, first))
    return _Block(
        view=view,
        tokens=tuple(tokens),
        planes=_as_slice(planes),
        layers=_as_slice(layers),
        w=slice(stripe.w_offset, stripe.w_offset + stripe.width),
        rows=_rows(geom, stripe, words, _storage_offset(stripe, first), (len(planes), len(layers)), (sp, sl)),
    )


def _rows(
    geom: KVGeometry,
    stripe: Stripe,
    words: torch.Tensor,
    origin: int,
    grid: tuple[int, int],
    grid_strides: tuple[int, int],
) -> _Rows | None:
    """Rows of `BS * width` words, if every block piece of the folded view is one run and the pieces sit a whole
    number of runs apart. The rows start at the first piece's offset modulo a run: storage need not begin on a row
    (a server's mapping of a client's shared memory starts 64 bytes before the KV, past torch's header)."""
    run = geom.bs * stripe.width
    if words.device.type != "cpu" or stripe.features != ((stripe.width, 1),):
        return None
    if geom.bs > 1 and (stripe.token_stride != stripe.width or stripe.token_tile != geom.bs):
        return None
    if any(x % run for x in (stripe.block_stride, *grid_strides)):
        return None
    shift = origin % run
    array = words.as_strided(((words.numel() - shift) // run, run), (run, 1), shift).numpy()
    planes = np.arange(grid[0], dtype=np.int64)[:, None] * (grid_strides[0] // run)
    layers = np.arange(grid[1], dtype=np.int64)[None, :] * (grid_strides[1] // run)
    return _Rows(array=array, base=origin // run + planes + layers, step=stripe.block_stride // run)


def _as_slice(values: list[int]) -> slice:
    step = values[1] - values[0] if len(values) > 1 else 1
    return slice(values[0], values[-1] + 1, step)
