"""Derive, from a layout declaration and the tensors an engine hands over, everything a copy needs.

`describe()` validates the tensors once (build it at registration time, not per request) and returns a
`KVGeometry`: the sizes of the seed's shape descriptor, the chunk-object shape, and a list of `Stripe`s. A stripe is
engine memory that fills one slice of the object row, for every (object plane, layer), with one stride pattern.
Every copy backend reads stripes; none of them knows about formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvferry.formats.codec import Codec
from kvferry.formats.kinds import EngineKVFormat
from kvferry.formats.layouts import Layout, layout_of, tail_factor

Feature = tuple[int, int]  # (size, stride in elements), outermost first


@dataclass(frozen=True, eq=False)
class Stripe:
    """One stride pattern of engine memory that fills object-row elements `[w_offset, w_offset + width)`.

    Entry `i` says: object plane `planes[i]` of layer `layers[i]` starts at element `offsets[i]` of
    `tensors[i]`; token `t` of block `b` is at `b * block_stride + (t // token_tile) * tile_stride +
    (t % token_tile) * token_stride`, and its features walk `features` (sizes multiply to `width`). Blocks are
    one tile (`token_tile == BS`, `tile_stride == 0`) except where the engine packs tokens in tiles (vLLM's AMX).
    """

    w_offset: int
    width: int
    block_stride: int
    token_stride: int
    token_tile: int
    tile_stride: int
    features: tuple[Feature, ...]
    planes: tuple[int, ...]
    layers: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class KVGeometry:
    """The engine's KV cache as kvferry sees it (the seed's PageBufferShapeDesc, plus where the bytes are).

    `width` is the engine's per-token row (its `nh` heads), `object_width` the chunk object's: wider when the engine
    holds a slice of the model's heads (a tensor-parallel rank, `first_head` of `total_heads`), whose columns of
    the object row it reads and writes. Objects then hold every head, whichever parallelism stored them.
    """

    fmt: EngineKVFormat
    layout: Layout
    dtype: torch.dtype
    device: torch.device
    element_size: int
    kv_size: int
    nl: int
    nb: int
    bs: int
    nh: int
    hs: int
    width: int
    block_stride_elems: int
    stripes: tuple[Stripe, ...]
    first_head: int = 0
    total_heads: int = 0  # 0: nh
    codec: Codec | None = None  # objects compressed (`kvferry.formats.codec.with_codec`); None: the engine's bytes

    def object_shape(self, chunk_size: int) -> tuple[int, int, int, int]:
        """`[kv_size, NL, chunk, W]` of `object_dtype`; a compressed row is `codec.row_bytes` bytes."""
        return (self.kv_size, self.nl, chunk_size, self.codec.row_bytes if self.codec else self.object_width)

    @property
    def object_dtype(self) -> torch.dtype:
        """The dtype of chunk objects: the engine's, or bytes for a compressed object."""
        return torch.uint8 if self.codec else self.dtype

    @property
    def object_width(self) -> int:
        return self.width // self.nh * self.total_heads if self.total_heads else self.width

    @property
    def partial_heads(self) -> bool:
        """Whether the engine holds only some of the heads its objects hold (a tensor-parallel rank)."""
        return self.object_width != self.width

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in a chunk object (every head)."""
        if self.codec:
            return self.kv_size * self.nl * self.codec.row_bytes
        return self.kv_size * self.nl * self.object_width * self.element_size


def flatten_paged(layout: Layout, paged: Any) -> list[tuple[torch.Tensor, dict[str, int], str]]:
    """Walk the engine's nesting; return (tensor, {level: index}, path for messages) per tensor."""
    out: list[tuple[torch.Tensor, dict[str, int], str]] = []
    _walk(layout, paged, 0, {}, "paged", out)
    return out


def _walk(layout: Layout, node: Any, depth: int, index: dict[str, int], path: str, out: list) -> None:
    # A module-level function, not a closure: a recursive closure is a reference cycle that would keep the
    # engine's tensors alive until the cycle collector runs (a server must unmap a departed client's KV at once).
    if depth == len(layout.nesting):
        if not isinstance(node, torch.Tensor):
            raise TypeError(f"{path} must be a torch.Tensor, got {type(node).__name__}")
        out.append((node, index, path))
        return
    level = layout.nesting[depth]
    if isinstance(node, torch.Tensor) or not isinstance(node, Sequence) or len(node) == 0:
        nest = " x ".join(layout.nesting)
        raise TypeError(f"{path} must be a non-empty list ({level} level; nesting {nest}), got {node!r:.60}")
    if level == "TWO" and len(node) != 2:
        raise ValueError(f"{path} must hold 2 entries (K and V), got {len(node)}")
    for i, child in enumerate(node):
        _walk(layout, child, depth + 1, {**index, level: i}, f"{path}[{i}]", out)


def describe(
    fmt: EngineKVFormat | int, paged: Any, block_size: int | None = None, heads: tuple[int, int] | None = None
) -> KVGeometry:
    """Validate `paged` against the layout of `fmt` and derive its geometry. Raises TypeError/ValueError.

    `heads=(first, total)`: the engine holds heads `first .. first + NH - 1` of the model's `total` KV heads (a
    tensor-parallel rank); objects then hold all `total` heads, this engine's in their columns.
    """
    fmt = EngineKVFormat(fmt) if isinstance(fmt, EngineKVFormat) else _format(fmt)
    layout = layout_of(fmt)
    entries = flatten_paged(layout, paged)
    first, _, _ = entries[0]
    _check_tensors(layout, entries)
    sizes = dict(zip(layout.axes, first.shape, strict=True))
    bs = _block_size(layout, sizes, block_size)
    nb = sizes["NB"] if "NB" in sizes else sizes["NBBS"] // bs
    nl = sizes["NL"] if "NL" in sizes else 1 + max(idx["NL"] for _, idx, _ in entries)
    nh = sizes.get("NH", 1)
    for axis, want in (("TWO", 2), ("ONE", 1)):
        if axis in sizes and sizes[axis] != want:
            raise ValueError(f"{fmt.name}: axis {axis} of paged tensors must have size {want}, got {sizes[axis]}")
    if "CS" in sizes and sizes["CS"] % 2:
        raise ValueError(f"{fmt.name}: the fused axis CS must be even (2*HS), got {sizes['CS']}")
    hs = sizes["CS"] // 2 if "CS" in sizes else sizes["HS"]
    plane_widths = _plane_widths(layout, entries)
    if "NP" in layout.nesting:
        hs = sum(plane_widths)
    first_head, total_heads = _head_slice(fmt, layout, nh, heads)
    head_shift = first_head * plane_widths[0] // nh  # columns of the object row before this engine's heads
    if layout.element_sizes is not None and first.element_size() not in layout.element_sizes:
        sizes_text = " or ".join(map(str, layout.element_sizes))
        raise TypeError(
            f"{fmt.name} moves {sizes_text}-byte elements; got dtype {first.dtype} ({first.element_size()} bytes)"
        )
    for axis, size in (("BS", bs), ("HS", hs)):
        multiple = layout.tail_multiple(axis)
        if size % multiple:
            raise ValueError(f"{fmt.name} packs {axis} in tiles of {multiple}: {axis}={size} is not a multiple")
    if first.element_size() not in (1, 2, 4, 8):
        raise TypeError(f"unsupported element size {first.element_size()} of dtype {first.dtype}")

    groups: dict[tuple, list[tuple[int, int, torch.Tensor, int]]] = {}
    for tensor, index, _ in entries:
        strides = dict(zip(layout.axes, tensor.stride(), strict=True))
        p = index.get("NP", 0)
        w_offset = sum(plane_widths[:p]) + head_shift
        layers = range(nl) if "NL" in strides else (index["NL"],)
        planes = _planes(layout, strides, index, bs, hs, nh, plane_widths[p])
        for plane, plane_offset, token_levels, features in planes:
            block_stride = strides["NB"] if "NB" in strides else bs * strides["NBBS"]
            feats = _normalise(features)
            key = (w_offset, plane_widths[p], block_stride, *_token_tiles(token_levels), feats)
            for layer in layers:
                offset = plane_offset + (layer * strides["NL"] if "NL" in strides else 0)
                groups.setdefault(key, []).append((plane, layer, tensor, offset))

    stripes = tuple(
        Stripe(
            w_offset=w_off,
            width=width,
            block_stride=bstride,
            token_tile=tile,
            token_stride=tstride,
            tile_stride=tile_stride,
            features=feats,
            planes=tuple(e[0] for e in members),
            layers=tuple(e[1] for e in members),
            tensors=tuple(e[2] for e in members),
            offsets=tuple(e[3] for e in members),
        )
        for (w_off, width, bstride, tile, tstride, tile_stride, feats), members in groups.items()
    )
    block_axis = "NB" if "NB" in layout.axes else "NBBS"
    return KVGeometry(
        fmt=fmt,
        layout=layout,
        dtype=first.dtype,
        device=first.device,
        element_size=first.element_size(),
        kv_size=layout.kv_size,
        nl=nl,
        nb=nb,
        bs=bs,
        nh=nh,
        hs=hs,
        width=sum(plane_widths),
        block_stride_elems=first.stride(layout.axes.index(block_axis)) * (bs if block_axis == "NBBS" else 1),
        stripes=stripes,
        first_head=first_head,
        total_heads=total_heads,
    )


def object_shape(
    fmt: EngineKVFormat | int, paged: Any, chunk_size: int = 256, block_size: int | None = None
) -> tuple[int, int, int, int]:
    """The chunk-object shape `[kv_size, NL, chunk, W]` for this engine's KV cache."""
    return describe(fmt, paged, block_size).object_shape(chunk_size)


def object_dtype(paged: Any) -> torch.dtype:
    """The dtype chunk objects use: the engine's KV dtype (the first tensor of `paged`)."""
    node = paged
    while isinstance(node, (list, tuple)) and node:
        node = node[0]
    if not isinstance(node, torch.Tensor):
        raise TypeError(f"paged must hold torch.Tensors, got {type(node).__name__}")
    return node.dtype


def _format(fmt: int) -> EngineKVFormat:
    layout_of(fmt)  # raises a ValueError listing the known formats
    return EngineKVFormat(fmt)


def _check_tensors(layout: Layout, entries: list[tuple[torch.Tensor, dict[str, int], str]]) -> None:
    first, _, first_path = entries[0]
    hs_axis = layout.axes.index("HS") if "NP" in layout.nesting else None
    for tensor, _, path in entries:
        if tensor.dim() != len(layout.axes):
            raise ValueError(f"{path} must have {len(layout.axes)} dims {layout.axes}, got shape {tuple(tensor.shape)}")
        if tensor.dtype != first.dtype or tensor.device != first.device:
            raise TypeError(
                f"{path} is {tensor.dtype} on {tensor.device} but {first_path} is {first.dtype} on {first.device}"
            )
        for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)):
            if stride < 0 or (stride == 0 and size > 1):
                raise ValueError(f"{path} has stride {stride} on dim {dim}: KV tensors cannot be expanded or flipped")
        want = list(first.shape)
        got = list(tensor.shape)
        if hs_axis is not None:  # planes may differ in width only
            want[hs_axis] = got[hs_axis]
        if got != want:
            raise ValueError(f"{path} has shape {tuple(got)} but {first_path} has {tuple(first.shape)}")
    if hs_axis is not None:
        widths: dict[int, int] = {}
        for tensor, index, path in entries:
            w = widths.setdefault(index["NP"], tensor.shape[hs_axis])
            if w != tensor.shape[hs_axis]:
                raise ValueError(
                    f"{path}: plane {index['NP']} has width {tensor.shape[hs_axis]} in one layer, {w} in another"
                )
    if "NL" in layout.nesting and "NP" in layout.nesting:
        counts = {idx["NL"]: 0 for _, idx, _ in entries}
        for _, idx, _ in entries:
            counts[idx["NL"]] += 1
        if len(set(counts.values())) != 1:
            raise ValueError(f"every layer must hold the same number of planes, got {counts}")


def _head_slice(fmt: EngineKVFormat, layout: Layout, nh: int, heads: tuple[int, int] | None) -> tuple[int, int]:
    if heads is None:
        return 0, nh
    if "NH" not in layout.axes:
        raise ValueError(f"{fmt.name} has no head axis: heads= does not apply (every rank holds the whole KV)")
    if len(heads) != 2 or not all(isinstance(h, int) and not isinstance(h, bool) for h in heads):
        raise ValueError(f"heads={heads!r} must be (first head, total heads), two integers")
    first, total = heads
    if first < 0 or first + nh > total:
        raise ValueError(f"heads={heads!r}: this engine's {nh} heads from head {first} do not fit in {total}")
    return first, total


def _block_size(layout: Layout, sizes: dict[str, int], block_size: int | None) -> int:
    if "BS" in sizes:
        if block_size is not None and block_size != sizes["BS"]:
            raise ValueError(f"block_size={block_size} disagrees with the tensors' BS axis ({sizes['BS']})")
        bs = sizes["BS"]
    else:
        if block_size is None:
            raise ValueError("this layout flattens blocks into token slots (NBBS): pass block_size=")
        if block_size <= 0 or sizes["NBBS"] % block_size:
            raise ValueError(f"block_size={block_size} must be positive and divide NB*BS={sizes['NBBS']}")
        bs = block_size
    if bs <= 0:
        raise ValueError("block size must be positive")
    return bs


def _plane_widths(layout: Layout, entries: list[tuple[torch.Tensor, dict[str, int], str]]) -> list[int]:
    if "NP" in layout.nesting:
        hs_axis = layout.axes.index("HS")
        widths: dict[int, int] = {}
        for tensor, index, _ in entries:
            widths[index["NP"]] = tensor.shape[hs_axis]
        return [widths[p] for p in sorted(widths)]
    first = entries[0][0]
    sizes = dict(zip(layout.axes, first.shape, strict=True))
    nh = sizes.get("NH", 1)
    if layout.split_tail is not None:
        return [nh * sizes["CS"] // 2]
    if layout.fused:
        return [nh * (sizes["CS"] if "CS" in sizes else 2 * sizes["HS"])]
    return [nh * sizes["HS"]]


def _planes(
    layout: Layout, strides: dict[str, int], index: dict[str, int], bs: int, hs: int, nh: int, width: int
) -> list[tuple[int, int, list[Feature], list[Feature]]]:
    """Per object plane held by one tensor: (plane, element offset, token levels, features); levels and features
    are (size, stride) pairs, outermost first."""
    tokens = [(bs, strides["BS"] if "BS" in strides else strides.get("NBBS", 0))]
    head = [(nh, strides["NH"])] if "NH" in strides else []
    if layout.split_tail is not None:
        if strides["CS"] != 1 or strides["BS"] != 2 * hs:
            raise ValueError(f"{layout.engines}: the (BS, CS) tail of each block must be contiguous")
        return [
            (plane, plane * bs * hs, *_tail_levels(order, bs, hs, head))
            for plane, order in enumerate(layout.split_tail)
        ]
    if layout.fused:
        if "CS" in strides:
            return [(0, 0, tokens, [*head, (2 * hs, strides["CS"])])]
        return [(0, 0, tokens, [*head, (2, strides["TWO"]), (hs, strides["HS"])])]
    feats = [*head, (width if "NP" in layout.nesting else hs, strides["HS"])]
    if "TWO" in strides:
        return [(k, k * strides["TWO"], tokens, feats) for k in range(2)]
    return [(index.get("TWO", 0), 0, tokens, feats)]


def _tail_levels(order: tuple[str, ...], bs: int, hs: int, head: list[Feature]) -> tuple[list[Feature], list[Feature]]:
    """(token levels, features) of one split-tail plane: each factor's stride is the product of the sizes of the
    factors inside it; an axis's levels are its factors, the tile index (`/n`) outside the position in it (`%n`)."""
    full = {"BS": bs, "HS": hs}
    levels: dict[str, dict[str, Feature]] = {"BS": {}, "HS": {}}
    stride = 1
    for axis, kind, n in map(tail_factor, reversed(order)):
        size = {"whole": full[axis], "outer": full[axis] // n, "inner": n}[kind]
        levels[axis][kind] = (size, stride)
        stride *= size
    rank = {"whole": 0, "outer": 0, "inner": 1}
    bs_levels, hs_levels = ([levels[a][k] for k in sorted(levels[a], key=rank.__getitem__)] for a in ("BS", "HS"))
    return bs_levels, [*head, *hs_levels]


def _token_tiles(levels: list[Feature]) -> tuple[int, int, int]:
    """(tokens per tile, token stride inside a tile, tile stride) from one or two token levels."""
    if len(levels) == 1:
        return levels[0][0], levels[0][1], 0
    (tiles, tile_stride), (tile, stride) = levels
    if tiles == 1:
        return tile, stride, 0
    if tile == 1:
        return tiles, tile_stride, 0
    if tile_stride == tile * stride:  # the tiles are back to back: one level
        return tiles * tile, stride, 0
    return tile, stride, tile_stride


def _normalise(features: list[Feature]) -> tuple[Feature, ...]:
    """Drop size-1 features and merge neighbours that are contiguous with each other (NHD heads + dims)."""
    merged: list[Feature] = []
    for size, stride in features:
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return tuple(merged) or ((1, 1),)
