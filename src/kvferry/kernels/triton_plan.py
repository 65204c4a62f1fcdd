"""What one engine KV cache's copies need that never changes between requests: its stripes in the kernel's units
(words, or the codec kernel's elements), their entry tables on the engine's device, and the alignment the kernels
may assume (`build_plan`; built once per geometry and cached by `kvferry.transfer`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.formats import Codec, KVGeometry
from kvferry.formats.geometry import Stripe
from kvferry.kernels.page_dma import PagePlan, page_plan


@dataclass(frozen=True)
class _StripeArgs:
    """A stripe converted to word units, with its entry tables on the engine's device."""

    base: torch.Tensor
    eng_off: torch.Tensor
    ent_row: torch.Tensor
    rows: tuple[int, ...]  # ent_row on the host, ascending: entries of a row range are one index range
    w_offset: int
    block_stride: int
    token_stride: int
    token_tile: int
    tile_stride: int
    sizes: tuple[int, int, int]
    strides: tuple[int, int, int]
    align: int = 1  # elements every token row's engine offset is a multiple of (up to 16 bytes; the codec kernel's)


@dataclass(frozen=True)
class TritonPlan:
    """Everything about one engine KV cache that does not change between requests (build once, reuse)."""

    bs: int
    width: int  # of an object row, elements
    partial_rows: bool  # the engine's KV fills only some columns of each object row (a slice of the model's heads)
    element_size: int
    bytes_per_token: int
    word: int
    stripes: tuple[_StripeArgs, ...]
    codec: Codec | None = None  # objects compressed: the codec kernel (`triton_codec`), engine side in elements
    pages: PagePlan | None = None  # where each page is one run of object rows: the copies of page DMA (`page_dma`)
    compiled: dict[tuple, Any] = field(default_factory=dict)  # launch shape -> compiled kernel
    graphs: dict[tuple, Any] = field(default_factory=dict)  # (lane, request shape) -> its captured CUDA graph

    @property
    def obj_row(self) -> int:
        """Words per token in one object row."""
        return self.width * self.element_size // self.word


def _word_size(geom: KVGeometry) -> int:
    es = geom.element_size
    base = geom.stripes[0].tensors[0].data_ptr()
    quantities = [geom.object_width * es, base]
    for s in geom.stripes:
        quantities += [s.w_offset * es, s.block_stride * es, s.token_stride * es, s.tile_stride * es]
        inner_size, inner_stride = s.features[-1]
        quantities.append(inner_size * es if inner_stride == 1 else es)
        quantities += [stride * es for _, stride in s.features[:-1]]
        quantities += [t.data_ptr() - base + off * es for t, off in zip(s.tensors, s.offsets, strict=True)]
    g = math.gcd(*quantities)
    return max(w for w in (8, 4, 2, 1) if g % w == 0)


def _row_alignment(s: Stripe, base: int, es: int) -> int:
    """Elements (up to 16 bytes' worth) that every engine token row offset of stripe `s` is a multiple of."""
    offsets = [t.data_ptr() - base + off * es for t, off in zip(s.tensors, s.offsets, strict=True)]
    return math.gcd(16, s.block_stride * es, s.token_stride * es, s.tile_stride * es, *offsets) // es


@functools.cache
def _upload_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _device_table(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, ready to be read by any stream when this returns.

    A GPU table goes up on a stream of its own that waits for nothing: on the caller's stream the copy, and with it
    the host (its source is pageable), would wait for the model's work queued there, so the first request of new KV
    would block its caller for as long as that work runs."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    stream = _upload_stream(device)
    with torch.cuda.stream(stream):
        table = host.to(device)
    stream.synchronize()  # a few hundred bytes: the kernels of any stream may read the table from now on
    return table


def build_plan(geom: KVGeometry) -> TritonPlan:
    word = geom.element_size if geom.codec else _word_size(geom)  # the codec kernel reads values, not words
    es = geom.element_size
    base = geom.stripes[0].tensors[0]
    args = []
    for s in geom.stripes:
        feats = list(s.features)
        inner_size, inner_stride = feats[-1]
        if inner_stride == 1:
            feats[-1] = (inner_size * es // word, 1)
            feats[:-1] = [(n, st * es // word) for n, st in feats[:-1]]
        else:  # a strided innermost feature moves element by element; word == element size then
            feats = [(n, st * es // word) for n, st in feats]
        while len(feats) < 3:
            feats.insert(0, (1, 0))
        off = [(t.data_ptr() - base.data_ptr() + o * es) // word for t, o in zip(s.tensors, s.offsets, strict=True)]
        rows = [p * geom.nl + layer for p, layer in zip(s.planes, s.layers, strict=True)]
        order = sorted(range(len(rows)), key=rows.__getitem__)  # by object row, so a slice of rows is a range
        args.append(
            _StripeArgs(
                base=base,
                eng_off=_device_table([off[i] for i in order], geom.device),
                ent_row=_device_table([rows[i] for i in order], geom.device),
                rows=tuple(rows[i] for i in order),
                w_offset=s.w_offset * es // word,
                block_stride=s.block_stride * es // word,
                token_stride=s.token_stride * es // word,
                token_tile=s.token_tile,
                tile_stride=s.tile_stride * es // word,
                sizes=(feats[0][0], feats[1][0], feats[2][0]),
                strides=(feats[0][1], feats[1][1], feats[2][1]),
                align=_row_alignment(s, base.data_ptr(), es) if geom.codec else 1,
            )
        )
    # The plan holds no reference to the geometry: plans are cached per geometry, weakly.
    return TritonPlan(
        bs=geom.bs,
        width=geom.codec.row_bytes if geom.codec else geom.object_width,
        partial_rows=geom.partial_heads,
        element_size=1 if geom.codec else geom.element_size,  # a compressed object is bytes
        bytes_per_token=geom.bytes_per_token,
        word=1 if geom.codec else word,  # the object side's unit
        stripes=tuple(args),
        codec=geom.codec,
        pages=page_plan(geom),
    )
