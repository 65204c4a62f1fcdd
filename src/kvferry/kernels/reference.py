"""The obviously-correct copy, for tests: named-axis views and a Python loop per block.

It does not use the derived geometry (strides, stripes): it re-reads the layout declaration and turns each engine
tensor into views `[NB, BS, *features]` by permuting named axes, then copies block by block. Slow on purpose.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvferry.formats import KVGeometry, flatten_paged
from kvferry.formats.layouts import tail_factor


def engine_views(geom: KVGeometry, paged: Any) -> list[tuple[int, int, int, torch.Tensor, int]]:
    """(object plane, layer, row offset, view [NB, BS, *features], token dims) for every piece of the engine's KV.

    A layout that packs tokens in tiles gives views `[NB, BS/n, n, *features]` (two token dims)."""
    layout = geom.layout
    views: list[tuple[int, int, int, torch.Tensor, int]] = []
    entries = flatten_paged(layout, paged)
    plane_widths = {idx.get("NP", 0): t.shape[-1] for t, idx, _ in entries}
    for tensor, index, _ in entries:
        names = list(layout.axes)
        t = tensor
        if "NBBS" in names:
            i = names.index("NBBS")
            t = t.unflatten(i, (geom.nb, geom.bs))
            names[i : i + 1] = ["NB", "BS"]
        pieces: list[tuple[int, torch.Tensor, list[str]]]
        if layout.split_tail is not None:
            t = t.flatten(-2).unflatten(-1, (2, geom.bs * geom.hs))
            pieces = []
            for plane, order in enumerate(layout.split_tail):
                factors = [tail_factor(f) for f in order]
                full = {"BS": geom.bs, "HS": geom.hs}
                sizes = tuple({"whole": full[a], "outer": full[a] // n, "inner": n}[k] for a, k, n in factors)
                factor_names = [a + ("_IN" if k == "inner" else "") for a, k, _ in factors]
                pieces.append((plane, t.select(-2, plane).unflatten(-1, sizes), [*names[:-2], *factor_names]))
        else:
            if "CS" in names:
                i = names.index("CS")
                t = t.unflatten(i, (2, geom.hs))
                names[i : i + 1] = ["KVF", "HS"]
            elif layout.fused:
                names[names.index("TWO")] = "KVF"
            pieces = [(index.get("TWO", 0), t, names)]
        for plane, piece, piece_names in pieces:
            for sub_plane, layer, view in _select_outer(piece, piece_names, index):
                plane_id = sub_plane if sub_plane is not None else plane
                w_offset = sum(w for p, w in plane_widths.items() if p < index.get("NP", 0))
                w_offset += geom.first_head * geom.width // geom.nh  # a slice of the model's heads
                views.append((plane_id, layer, w_offset, view, 1 + ("BS_IN" in piece_names)))
    return views


def _select_outer(
    t: torch.Tensor, names: list[str], index: dict[str, int]
) -> list[tuple[int | None, int, torch.Tensor]]:
    """Split off in-tensor layer and K/V axes, drop ONE axes, order the rest as [NB, BS, NH, KVF, HS] (a tile
    split of BS or HS puts the position inside the tile, `_IN`, right after the tile index)."""
    out = []
    layers = range(t.shape[names.index("NL")]) if "NL" in names else [index["NL"]]
    planes: list[int | None] = list(range(2)) if "TWO" in names else [None]
    for layer in layers:
        for plane in planes:
            v, n = t, list(names)
            if "NL" in n:
                v = v.select(n.index("NL"), layer)
                n.remove("NL")
            if plane is not None:
                v = v.select(n.index("TWO"), plane)
                n.remove("TWO")
            while "ONE" in n:
                v = v.squeeze(n.index("ONE"))
                n.remove("ONE")
            order = [a for a in ("NB", "BS", "BS_IN", "NH", "KVF", "HS", "HS_IN") if a in n]
            out.append((plane, layer, v.permute(*[n.index(a) for a in order])))
    return out


def copy_reference(
    geom: KVGeometry,
    paged: Any,
    objects: list[torch.Tensor],
    block_ids: list[int],
    to_objects: bool,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> None:
    views = engine_views(geom, paged)
    per_object = chunk_size // geom.bs
    for j, block in enumerate(block_ids):
        if j < skip_prefix_blocks:
            continue
        obj = objects[j // per_object]
        tok = (j % per_object) * geom.bs
        for plane, layer, w_offset, view, token_dims in views:
            engine = view[block]
            tokens, features = engine.shape[:token_dims], engine.shape[token_dims:]
            piece = obj[plane, layer, tok : tok + geom.bs, w_offset : w_offset + math.prod(features)]
            piece = piece.unflatten(-1, features).unflatten(0, tokens)
            if to_objects:
                piece.copy_(engine)
            else:
                engine.copy_(piece)
