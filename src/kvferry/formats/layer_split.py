"""Layers kept exact beside a codec (vLLM's ``--kv-cache-dtype-skip-layers``): an engine's KV cut into parts.

A `LayerSplit` is data: the engine's layers in parts, each with the codec of its objects (the exact layers' part
``none``, the others the codec asked for). Each part is KV of its own, as a hybrid model's KV cache groups are
(`kvferry.connector.kv_groups`): its own objects, geometry and key space, the split's `tag` its key space's
``split`` (`kvferry.cache.CacheNamespace`), so a part never shares a key with an unsplit key space of the model
(exact or coded) nor with another split's. A hit is the longest prefix every part holds.

Why parts, not a per-layer flag inside one object: an exact layer's row is twice as wide as a coded one, which the
uniform object rows (`[kv, NL, chunk, W]`), the copy kernels, the pool, the tiers and the key spaces of tensor-
parallel slices would all have to learn; as parts, every one of those runs unchanged, and `select_layers` picks a
part's layers as views of the engine's tensors (no copy), whatever its format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvferry.formats.codec import CODECS
from kvferry.formats.kinds import EngineKVFormat
from kvferry.formats.layouts import layout_of


@dataclass(frozen=True)
class LayerPart:
    """Positions (in the engine's layer order) of the layers whose objects are in ``codec``."""

    layers: tuple[int, ...]
    codec: str


@dataclass(frozen=True)
class LayerSplit:
    """An engine's layers in parts; ``tag`` names the split in key spaces ("" when there is one part)."""

    parts: tuple[LayerPart, ...]
    tag: str


def layer_split(num_layers: int, codec: str, exact_layers: Sequence[int] = ()) -> LayerSplit:
    """The split of ``num_layers`` layers whose ``exact_layers`` (positions; negative counts from the last) keep
    the engine's bytes while the others are in ``codec``. One part when nothing is left to split: no exact layers,
    codec ``none``, or every layer exact (an exact engine's key space: the objects are the same). ValueError for a
    position out of range."""
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r} is not one of {CODECS}")
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    bad = [i for i in exact_layers if not -num_layers <= i < num_layers]
    if bad:
        raise ValueError(f"exact_layers {bad} are not layers of this KV cache (layers 0..{num_layers - 1})")
    exact = sorted({i % num_layers for i in exact_layers})
    if codec == "none" or not exact or len(exact) == num_layers:
        return LayerSplit((LayerPart(tuple(range(num_layers)), "none" if exact else codec),), "")
    rest = tuple(i for i in range(num_layers) if i not in set(exact))
    tag = f"exact_layers={','.join(map(str, exact))}"
    return LayerSplit((LayerPart(tuple(exact), "none"), LayerPart(rest, codec)), tag)


def select_layers(fmt: EngineKVFormat | int, paged: Any, layers: Sequence[int]) -> Any:
    """``paged`` (an engine's KV in format ``fmt``) restricted to ``layers`` (ascending positions), as views of
    its tensors. A layout with a layer list takes any layers; one whose tensors hold the layer axis takes layers
    evenly spaced (a strided view: e.g. the first and the last, or a run), else ValueError saying so."""
    layout = layout_of(fmt)
    if not layers or list(layers) != sorted(set(layers)):
        raise ValueError(f"layers={list(layers)} must be ascending distinct positions")
    if "NL" in layout.nesting:
        return _pick(paged, layout.nesting.index("NL"), list(layers))
    step = layers[1] - layers[0] if len(layers) > 1 else 1
    if any(b - a != step for a, b in pairwise(layers)):
        raise ValueError(
            f"{EngineKVFormat(fmt).name} holds its layers inside each tensor: layers {list(layers)} are not evenly "
            "spaced, so they are no view of it (keep exact layers evenly spaced, e.g. the first and the last)"
        )
    index = (slice(None),) * layout.axes.index("NL") + (slice(layers[0], layers[-1] + 1, step),)
    return _each_tensor(paged, len(layout.nesting), index)


def _pick(node: Any, depth: int, layers: list[int]) -> list[Any]:
    if depth == 0:
        return [node[i] for i in layers]
    return [_pick(child, depth - 1, layers) for child in node]


def _each_tensor(node: Any, depth: int, index: tuple[slice, ...]) -> Any:
    if depth == 0:
        return node[index]
    return [_each_tensor(child, depth - 1, index) for child in node]
