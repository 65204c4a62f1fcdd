"""The CPU copy over all of the engine's storages at once: one call per run of objects, however the KV is allocated.

Engines allocate their KV per layer (vLLM: a tensor per layer), and a copy per storage is a call per (layer, plane,
object): 768 calls of 64 KiB for 16 chunks of qwen2.5-0.5b, 0.08 of a memcpy on the CPU machine. Here the address
range from the lowest storage to the end of the highest is one strided view `[rows, *piece]` per stripe whose rows
start one word apart: row `address - low` (in words) is the block piece at that address, in any storage. Rows
overlap and the range holds other memory between the storages; only the rows of checked block ids are touched, and
the plan keeps the engine's tensors (the memory under every row it names) alive.

A store is `torch.index_select(rows, 0, offsets, out=<object pieces>)` per run of objects adjacent in memory: its
memcpy-per-row path needs each row contiguous (a token-major piece), not the view. A retrieve is numpy's
`rows[offsets] = <object pieces>`; both spread over threads as `cpu_threads` says. Pieces that are not single
runs (HND heads, a transposed K, AMX tiles) take the same calls, copied element-wise within each row.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvferry.formats import KVGeometry, Stripe
from kvferry.kernels import cpu_threads
from kvferry.kernels.cpu_threads import CopyJob, Gather, Scatter

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_VIEW_BYTES = 1 << 62  # numpy refuses a view whose shape spans more bytes than an int64 counts
_SLAB_BYTES = 2 << 20  # permuted pieces go through a buffer this big: it stays in the CPU's caches between its copies


class _Memory:
    """Raw memory as numpy sees an array's buffer: views over it hold no reference to what owns the memory."""

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], element_size: int) -> None:
        self.__array_interface__ = {
            "data": (address, False),
            "shape": shape,
            "strides": strides,
            "typestr": np.dtype(f"i{element_size}").str,
            "version": 3,
        }


@dataclass(frozen=True)
class _Entries:
    """One stripe: its block pieces as rows of the span, and where they go in an object."""

    rows: torch.Tensor  # [n, *tokens, *features] words; row r starts r words past the span's start
    rows_np: np.ndarray  # the same view, for numpy's scatter
    first: np.ndarray  # int64 [P', L']: the row of each (plane, layer)'s block 0 piece
    block_stride: int  # rows (words) from one block's piece to the next
    planes: slice
    layers: slice
    w: slice
    tokens: tuple[int, ...]
    features: tuple[int, ...]
    runs: torch.Tensor | None  # [n, numel]: where each piece fills `numel` consecutive words in another order
    runs_np: np.ndarray | None
    piece_strides: tuple[int, ...]  # a piece's strides (words), in the object's order of its dims
    in_order: bool  # a piece's elements are in the object's order (token-major)
    token_stride: int = 0  # words between a piece's tokens where each token is a row of its own (0: a piece a row)


@dataclass(frozen=True)
class SpanPlan:
    bs: int
    word: torch.dtype
    entries: tuple[_Entries, ...]
    tensors: tuple[torch.Tensor, ...]  # the engine's tensors: the views above do not keep their memory alive

    @property
    def fold_stores(self) -> tuple[int, ...]:
        """Stripes whose stores are better folded per storage: pieces neither in the object's order nor filling a
        run (vLLM's CPU layouts, a head's K^T beside its V). A row of them costs torch a TensorIterator of its own
        (16 llama3-8b chunks stored at 0.09 of the copy), while a folded storage's index over blocks copies every
        layer of a block in one (0.24-0.33)."""
        return tuple(i for i, e in enumerate(self.entries) if not e.in_order and e.runs is None)

    @property
    def permuted(self) -> tuple[int, ...]:
        """Stripes whose pieces are not in the object's order."""
        return tuple(i for i, e in enumerate(self.entries) if not e.in_order)


class _Run(NamedTuple):
    """Objects `first .. first + n - 1` (adjacent in memory when more than one), block entries `j0 .. j1 - 1`."""

    first: int
    n: int  # not `count`: a NamedTuple field would hide tuple.count
    j0: int
    j1: int


def build_span(geom: KVGeometry) -> SpanPlan | None:
    """The span plan for a CPU geometry; None where a stripe's entries are not a (plane x layer) grid."""
    if geom.device.type != "cpu":
        return None
    es = geom.element_size
    tensors = tuple({id(t): t for s in geom.stripes for t in s.tensors}.values())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    low, high = min(storages), max(ptr + n for ptr, n in storages.items())
    if low % es:
        return None
    entries = []
    for stripe in geom.stripes:
        entry = _entries(geom, stripe, low, (high - low) // es)
        if entry is None:
            return None
        entries.append(entry)
    return SpanPlan(bs=geom.bs, word=_WORD[es], entries=tuple(entries), tensors=tensors)


def copy_span(
    plan: SpanPlan,
    objects: list[torch.Tensor],
    ids: np.ndarray,
    to_objects: bool,
    chunk_size: int,
    skip_prefix_blocks: int,
    folded: frozenset[int] = frozenset(),
) -> None:
    """Copy every stripe but those in `folded` (the caller copies those per storage)."""
    per = chunk_size // plan.bs
    own_threads = cpu_threads.on_own_threads()
    jobs: list[CopyJob] = []
    for run in _runs(objects, plan.bs, per, len(ids), skip_prefix_blocks):
        obj = objects[run.first].view(plan.word)
        batch = obj.as_strided((run.n, *obj.shape), (obj.numel(), *obj.stride()))
        base = run.first * per
        tokens = slice((run.j0 - base) * plan.bs, (run.j1 - base) * plan.bs)
        run_ids = ids[run.j0 : run.j1].reshape(run.n, -1)
        for stripe, e in enumerate(plan.entries):
            if stripe in folded:
                continue
            view = batch[:, e.planes, e.layers, tokens, e.w]
            view = view.unflatten(3, (run_ids.shape[1], *e.tokens)).unflatten(-1, e.features)
            offsets = e.first[None, :, :, None] + run_ids[:, None, None, :] * e.block_stride
            if e.token_stride:  # a row per token: [objects, P', L', blocks, tokens]
                offsets = offsets[..., None] + np.arange(plan.bs, dtype=np.int64) * e.token_stride
            try:  # one row axis over the run's pieces (not where the stripe holds some of an object's planes or tokens)
                rows = view.view(-1, *view.shape[4 + (e.token_stride > 0) :])
            except RuntimeError:
                rows = None
            if e.runs is not None and rows is not None:
                permuted = _Permuted(e, offsets.reshape(-1), rows, to_objects)
                if own_threads:
                    jobs.append(permuted)
                else:
                    permuted.run()  # its torch copies on torch's threads
            elif to_objects and rows is not None:
                gather = Gather(e.rows, torch.from_numpy(offsets.reshape(-1)), rows)
                if own_threads:
                    jobs.append(gather)
                else:
                    gather.run()  # now, on torch's threads
            elif to_objects:
                view.copy_(torch.index_select(e.rows, 0, torch.from_numpy(offsets.reshape(-1))).view(view.shape))
            elif rows is not None:
                jobs.append(Scatter(e.rows_np, offsets.reshape(-1), rows.numpy()))
            else:
                jobs.append(Scatter(e.rows_np, offsets, view.numpy()))  # index [objects, P', L', blocks]
    if jobs:
        cpu_threads.run(jobs)


class _Permuted(NamedTuple):
    """Pieces that fill whole runs of engine memory in another order than the object's (heads before tokens), moved
    as whole runs (a memcpy per row) through a small buffer and permuted there by one strided copy: torch copies a
    strided row with a TensorIterator of its own (HND stores of 16 qwen2.5-0.5b chunks, a tensor per layer: 0.26-0.32
    of the copy this way, 0.09-0.12 per storage)."""

    entries: _Entries
    at: np.ndarray  # [n] rows of the span
    pieces: torch.Tensor  # [n, *piece]: the objects' pieces
    to_objects: bool

    @property
    def nbytes(self) -> int:
        return self.pieces.numel() * self.pieces.element_size()

    def split(self, parts: int) -> list[_Permuted]:
        bounds = np.linspace(0, len(self.at), parts + 1, dtype=np.int64).tolist()
        return [self._replace(at=self.at[a:b], pieces=self.pieces[a:b]) for a, b in itertools.pairwise(bounds)]

    def run(self) -> None:
        e, n = self.entries, len(self.at)
        assert e.runs is not None and e.runs_np is not None
        numel = e.runs.shape[1]
        step = max(1, _SLAB_BYTES // (numel * self.pieces.element_size()))
        buffer = torch.empty((min(step, n), numel), dtype=self.pieces.dtype)
        for a in range(0, n, step):
            b = min(a + step, n)
            runs = buffer[: b - a]
            in_object_order = runs.as_strided((b - a, *self.pieces.shape[1:]), (numel, *e.piece_strides))
            if self.to_objects:
                torch.index_select(e.runs, 0, torch.from_numpy(self.at[a:b]), out=runs)
                self.pieces[a:b].copy_(in_object_order)
            else:
                in_object_order.copy_(self.pieces[a:b])
                e.runs_np[self.at[a:b]] = runs.numpy()


def _runs(objects: list[torch.Tensor], bs: int, per: int, n: int, skip: int) -> list[_Run]:
    """The request's objects in runs: whole objects that follow each other in one storage go together."""
    runs: list[_Run] = []
    end = storage = -1
    for o, obj in enumerate(objects):
        j0, j1 = max(o * per, skip), min(o * per + obj.shape[2] // bs, n)
        if j0 >= j1:
            continue
        whole = j0 == o * per and j1 - j0 == per
        here = obj.untyped_storage().data_ptr()
        if whole and runs and end == obj.data_ptr() and storage == here:
            last = runs[-1]
            runs[-1] = last._replace(n=last.n + 1, j1=j1)
        else:
            runs.append(_Run(o, 1, j0, j1))
        end, storage = (obj.data_ptr() + obj.nbytes, here) if whole else (-1, -1)
    return runs


def _entries(geom: KVGeometry, stripe: Stripe, low: int, words: int) -> _Entries | None:
    planes, layers = sorted(set(stripe.planes)), sorted(set(stripe.layers))
    cells = set(zip(stripe.planes, stripe.layers, strict=True))
    if len(cells) != len(stripe.planes) or len(cells) != len(planes) * len(layers):
        return None
    if not (evenly_spaced(planes) and evenly_spaced(layers)):
        return None
    es = geom.element_size
    first = np.empty((len(planes), len(layers)), dtype=np.int64)
    for i, t in enumerate(stripe.tensors):
        address = t.untyped_storage().data_ptr() + (t.storage_offset() + stripe.offsets[i]) * es
        first[planes.index(stripe.planes[i]), layers.index(stripe.layers[i])] = (address - low) // es
    if stripe.token_tile == geom.bs:
        tokens, token_strides = [geom.bs], [stripe.token_stride]
    else:
        tokens = [geom.bs // stripe.token_tile, stripe.token_tile]
        token_strides = [stripe.tile_stride, stripe.token_stride]
    sizes = [*tokens, *(n for n, _ in stripe.features)]
    strides = [*token_strides, *(s for _, s in stripe.features)]
    if min(strides) < 0 or stripe.block_stride < 0:
        return None
    n_rows = words - sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    if n_rows * math.prod(sizes) * es >= _MAX_VIEW_BYTES:
        return None
    rows_np = np.asarray(_Memory(low, (n_rows, *sizes), (es, *(s * es for s in strides)), es))
    numel = math.prod(sizes)
    in_order = strides == _row_major(sizes)
    dense = 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)) == numel
    runs_np = np.asarray(_Memory(low, (words - numel + 1, numel), (es, es), es)) if dense and not in_order else None
    token_stride = 0
    if not in_order and runs_np is None and _token_rows(sizes, strides, len(tokens), es):
        # Tokens apart, each token's features one run (SGLang's page_first host pool: a token holds every layer):
        # each token a row of its own, copied whole, instead of a block piece copied element by element.
        token_stride, sizes, strides, in_order = strides[0], sizes[1:], strides[1:], True
        n_rows = words - sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
        rows_np = np.asarray(_Memory(low, (n_rows, *sizes), (es, *(s * es for s in strides)), es))
    return _Entries(
        rows=torch.from_numpy(rows_np),
        rows_np=rows_np,
        first=first,
        block_stride=stripe.block_stride,
        planes=as_slice(planes),
        layers=as_slice(layers),
        w=slice(stripe.w_offset, stripe.w_offset + stripe.width),
        tokens=tuple(tokens),
        features=tuple(n for n, _ in stripe.features),
        runs=torch.from_numpy(runs_np) if runs_np is not None else None,
        runs_np=runs_np,
        piece_strides=tuple(strides),
        in_order=in_order,
        token_stride=token_stride,
    )


_MIN_TOKEN_ROW_BYTES = 256  # a token row shorter than this copies slower alone than within its block's piece


def _token_rows(sizes: list[int], strides: list[int], token_dims: int, element_size: int) -> bool:
    """Whether a piece's tokens are better rows of their own: one token axis, each token's features in the object's
    order and long enough, no two tokens overlapping."""
    features = sizes[1:]
    return (
        token_dims == 1
        and strides[1:] == _row_major(features)
        and strides[0] >= math.prod(features)
        and math.prod(features) * element_size >= _MIN_TOKEN_ROW_BYTES
    )


def _row_major(sizes: list[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= n
    return strides[::-1]


def evenly_spaced(values: list[int]) -> bool:
    return len(values) < 2 or len({b - a for a, b in itertools.pairwise(values)}) == 1


def as_slice(values: list[int]) -> slice:
    step = values[1] - values[0] if len(values) > 1 else 1
    return slice(values[0], values[-1] + 1, step)
