"""Recognise vLLM's per-layer page views (its GPU backends' KV cache) from their strides, and name the kvferry format.

vLLM (0.32) allocates one flat int8 buffer and hands a connector one 4-D view per attention layer with the logical
axes ``[B, H, N, C]``: blocks, KV heads, tokens in a block, and the content of one (head, token) cell -- K then V
for attention (``head_size + head_size_v`` elements), the latent for MLA -- viewed in the cache's dtype (uint8
for fp8 caches). One of six physical orders (``KVCacheLayout``: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) places
them in memory; the B-outermost ones are cross-layer (each block holds every layer's page). Pages may be padded
(MLA's alignment) and a view may split each scheduler block into kernel blocks (``N`` is then the kernel block).

Nothing here reads a backend's name: the order is read off the views' strides and the distance between layers,
so a backend with a new order of these axes needs no code. Every order maps onto a declared format whose strides
the geometry takes as they are: layer-compact orders onto per-layer fused formats (12, 13), B-outermost ones onto
the cross-layer pair (100, 101) as one tensor, MLA onto 3. All of them store the same object bytes (K and V fused
per head, token-major), so the cache keys them alike (`kvferry.cache.request.layout_name`) and engines of different
orders share objects. Views that fit none of this are refused with what was found.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvferry.connector.engine_kv import UnsupportedKVLayout
from kvferry.formats import EngineKVFormat

F = EngineKVFormat


@dataclass(frozen=True)
class PageViews:
    """What `read_views` found: the format, what to hand kvferry's copies (per-layer tensors, or one cross-layer
    tensor), vLLM's physical order (e.g. ``"LBNHC"``) and the tokens of one view block (a kernel block)."""

    fmt: EngineKVFormat
    paged: list[torch.Tensor] | torch.Tensor
    order: str
    block_tokens: int


def read_views(layers: Sequence[torch.Tensor], names: Sequence[str], *, mla: bool) -> PageViews:
    """The format of vLLM's per-layer ``[B, H, N, C]`` views ``layers`` (in layer order; ``names`` for messages).
    ``mla``: the model uses MLA (vLLM's ``model_config.use_mla``), whose views hold one latent per token."""
    first = layers[0]
    for name, t in zip(names, layers, strict=True):
        if t.dim() != 4 or t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise UnsupportedKVLayout(
                f"kv_caches[{name!r}] is {tuple(t.shape)} {t.dtype} with strides {t.stride()}; expected vLLM's "
                f"per-layer [B, H, N, C] views, all like {tuple(first.shape)} {first.dtype} {first.stride()}"
            )
        if t.device != first.device or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            raise UnsupportedKVLayout(f"kv_caches[{name!r}] is not a view of the buffer that holds the first layer")
    nb, nh, bs, content = first.shape
    strides = dict(zip("BHNC", first.stride(), strict=True))
    if strides["C"] != 1:
        raise UnsupportedKVLayout(f"the views' content axis C has stride {strides['C']}; vLLM's pages keep it dense")
    layer_stride = _layer_stride(layers)
    sizes = {"B": nb, "H": nh, "N": bs, "C": content}
    axes = "BHN" if layer_stride is None else "LBHN"
    if layer_stride is not None:
        strides["L"] = layer_stride
        sizes["L"] = len(layers)
    order = "".join(sorted(axes, key=lambda a: (-strides[a], -sizes[a]))) + "C"
    _check_disjoint(order, strides, sizes)
    cross_layer = layer_stride is not None and order.index("B") < order.index("L")
    heads_outside = order.index("H") < order.index("N")
    if mla:
        if nh != 1:
            raise UnsupportedKVLayout(f"an MLA cache holds one latent per token, but the views have {nh} heads")
        return PageViews(F.NL_X_NB_BS_HS, [t[:, 0] for t in layers], order, bs)
    if content % 2:
        raise UnsupportedKVLayout(f"the views' content axis holds {content} elements: not K and V of one head size")
    if not cross_layer:
        if heads_outside:  # LBHNC, LHBNC: the per-layer tensors as they are
            return PageViews(F.NL_X_NB_NH_BS_CS, list(layers), order, bs)
        return PageViews(F.NL_X_NB_BS_NH_CS, [t.permute(0, 2, 1, 3) for t in layers], order, bs)
    assert layer_stride is not None
    base = first.as_strided((nb, len(layers), nh, bs, content), (strides["B"], layer_stride, strides["H"],
                            strides["N"], 1))  # fmt: skip
    if heads_outside:  # BLHNC, BHLNC
        return PageViews(F.NB_NL_NH_BS_CS, base, order, bs)
    return PageViews(F.NB_NL_BS_NH_CS, base.permute(0, 1, 3, 2, 4), order, bs)


def _layer_stride(layers: Sequence[torch.Tensor]) -> int | None:
    """Elements from one layer's view to the next, when they are evenly spaced in one buffer; None for one layer."""
    if len(layers) < 2:
        return None
    size = layers[0].element_size()
    gaps = {(b.data_ptr() - a.data_ptr()) for a, b in itertools.pairwise(layers)}
    if len(gaps) != 1 or (gap := gaps.pop()) <= 0 or gap % size:
        raise UnsupportedKVLayout(
            "the layers' views are not evenly spaced in their buffer, in layer order: not one of vLLM's layouts"
        )
    return gap // size


def _check_disjoint(order: str, strides: dict[str, int], sizes: dict[str, int]) -> None:
    """Each axis must step over the whole extent of the axes inside it (padding allowed): otherwise two cells
    share bytes, and a load into one would overwrite another."""
    extent = sizes["C"]
    for axis in reversed(order[:-1]):
        if sizes[axis] > 1 and strides[axis] < extent:
            raise UnsupportedKVLayout(
                f"the views' axis {axis} has stride {strides[axis]} < {extent}, the extent of the axes inside it "
                f"(physical order {order}): cells would overlap"
            )
        extent = max(extent, strides[axis] * (sizes[axis] - 1) + extent) if sizes[axis] > 1 else extent
