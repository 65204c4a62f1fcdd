"""Vectorised torch copy: one gather or scatter per (stripe, object), no loop per block or layer.

On the CPU the copy goes over every storage at once (`cpu_span`), except where a fold does better (`build_plan`).
Elsewhere (the torch backend on a GPU, and a CPU geometry whose stripes are not (plane x layer) grids, which
`describe` does not make), each stripe's entries are folded into strided views `[planes, layers, NB, BS, *features]`
over the engine's storage where they are evenly spaced in it (engines that allocate their layers as views of one
buffer): stores gather with `index_select(..., out=<object slice>)`, retrieves scatter with numpy on the CPU
(`cpu_threads`) and `index_copy_` on a GPU. Numbers: BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.formats import KVGeometry, Stripe
from kvferry.kernels import cpu_threads
from kvferry.kernels.cpu_span import SpanPlan, as_slice, build_span, copy_span, evenly_spaced
from kvferry.kernels.cpu_threads import Scatter

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class _Block:
    """Evenly spaced stripe entries as one strided engine view, and where they go in an object."""

    view: torch.Tensor  # [P, L, NB, *tokens, *features], dtype = the word type of the element size
    tokens: tuple[int, ...]  # (BS,), or (BS / tile, tile) where the engine packs tokens in tiles
    planes: slice
    layers: slice
    w: slice


@dataclass(frozen=True)
class TorchPlan:
    bs: int
    element_size: int
    device: torch.device
    blocks: tuple[_Block, ...]  # every stripe's without a span; with one, those of the stripes in `folded_stores`
    span: SpanPlan | None
    folded_stores: frozenset[int]  # stripes whose stores fold (every one without a span)
    folded_retrieves: frozenset[int]  # stripes whose retrieves fold
    block_stripes: tuple[int, ...]  # the stripe of each block


def build_plan(geom: KVGeometry) -> TorchPlan:
    """On the CPU, the span, except where a fold does better: the stores of `SpanPlan.fold_stores` stripes, and both
    directions of stripes whose pieces are out of the object's order where the whole stripe folds into one view (an
    index over blocks then copies every layer of a block at once: vLLM's CPU layout retrieved 16 llama3-8b chunks at
    0.44 of the copy that way, 0.28 row by row; HND up to 1.2x faster than permuting runs). Spread over a tensor per
    layer, a fold is a call per layer and the span wins (HND 3-3.9x, vLLM's CPU layout retrieved 3.7x faster)."""
    span = build_span(geom)
    word = _WORD[geom.element_size]
    stores = set(range(len(geom.stripes)) if span is None else span.fold_stores)
    retrieves = set(range(len(geom.stripes))) if span is None else set()
    blocks: list[_Block] = []
    block_stripes: list[int] = []
    for i in sorted(stores | set(span.permuted if span is not None else ())):
        groups = _even_groups(geom.stripes[i])
        if len(groups) == 1:
            stores.add(i)
            retrieves.add(i)
        elif i not in stores:
            continue
        for members in groups:
            blocks.append(_fold(geom, geom.stripes[i], members, word))
            block_stripes.append(i)
    return TorchPlan(
        bs=geom.bs,
        element_size=geom.element_size,
        device=geom.device,
        blocks=tuple(blocks),
        span=span,
        folded_stores=frozenset(stores),
        folded_retrieves=frozenset(retrieves),
        block_stripes=tuple(block_stripes),
    )


def copy_torch(
    plan: TorchPlan,
    objects: list[torch.Tensor],
    block_ids: torch.Tensor,
    to_objects: bool,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> None:
    folded = plan.folded_stores if to_objects else plan.folded_retrieves
    if plan.span is not None and len(folded) < len(plan.span.entries):
        copy_span(plan.span, objects, block_ids.numpy(), to_objects, chunk_size, skip_prefix_blocks, folded)
    if not folded:
        return
    word = _WORD[plan.element_size]
    per_object = chunk_size // plan.bs
    n = len(block_ids)
    on_cpu = plan.device.type == "cpu"
    scatters: list[Scatter] = []  # CPU retrieves, run together at the end over threads
    for o, obj in enumerate(objects):
        j0, j1 = max(o * per_object, skip_prefix_blocks), min(o * per_object + obj.shape[2] // plan.bs, n)
        if j0 >= j1:
            continue
        tokens = slice((j0 - o * per_object) * plan.bs, (j1 - o * per_object) * plan.bs)
        obj_w = obj.view(word)
        for b, stripe in zip(plan.blocks, plan.block_stripes, strict=True):
            if stripe not in folded:
                continue
            piece = obj_w[b.planes, b.layers, tokens, b.w]
            piece = piece.unflatten(2, (j1 - j0, *b.tokens)).unflatten(-1, b.view.shape[3 + len(b.tokens) :])
            if to_objects:
                torch.index_select(b.view, 2, block_ids[j0:j1], out=piece)
            elif on_cpu:  # numpy's view[:, :, ids] = piece: each block's every layer in one assignment
                scatters.append(Scatter(b.view.numpy(), block_ids[j0:j1].numpy(), piece.numpy(), axis=2))
            else:
                b.view.index_copy_(2, block_ids[j0:j1], piece)
    if scatters:
        cpu_threads.run(scatters)


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
    if len(planes) * len(layers) != len(members) or not (evenly_spaced(planes) and evenly_spaced(layers)):
        return None
    where = {(stripe.planes[i], stripe.layers[i]): _storage_offset(stripe, i) for i in members}
    origin = where[(planes[0], layers[0])]
    sp = where[(planes[1], layers[0])] - origin if len(planes) > 1 else 0
    sl = where[(planes[0], layers[1])] - origin if len(layers) > 1 else 0
    for (p, layer), off in where.items():
        if off != origin + planes.index(p) * sp + layers.index(layer) * sl:
            return None
    return sp, sl


def _storage_offset(stripe: Stripe, i: int) -> int:
    t = stripe.tensors[i]
    return int(t.storage_offset()) + stripe.offsets[i]  # int: a SymInt only under tracing


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
        planes=as_slice(planes),
        layers=as_slice(layers),
        w=slice(stripe.w_offset, stripe.w_offset + stripe.width),
    )
