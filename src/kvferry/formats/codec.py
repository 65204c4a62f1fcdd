"""Chunk-object codecs: how a compressed object lays out its bytes, and which engine caches can take one.

`fp8`: every object row (one plane of one layer, one token) holds the row's `W` values as fp8 e4m3 bytes, then one
float32 scale per group of `group` consecutive values: `[W bytes | W/group float32]`. A group is one head's vector
(`group` = the head size, or its largest power-of-two divisor up to 128: MLA's 576 = 9 groups of 64, its 512-wide
latent and 64-wide rope part scaled apart). Value `v` of a group with largest magnitude `amax` is stored as
`e4m3(v * 448 / amax)` (rounded to nearest even) and read back as `byte * amax / 448`.

Why per token and head, not per layer, head and chunk: a token's row is then self-contained, so a store that skips
an engine-held prefix, a partial last chunk, a copy cut into row ranges and a tensor-parallel rank writing its own
heads all work as for exact objects; and heavy-tailed tokens do not flatten their whole chunk's scale
(docs/codec.md has the measured errors of both). llama3-8b's 2048-byte bf16 row becomes 1056 bytes (1.94x).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvferry.formats.geometry import KVGeometry

CODECS = ("none", "fp8")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_BYTES = 4  # one float32 per group
_ENGINE_DTYPES = (torch.bfloat16, torch.float16)  # what fp8 can compress (fp32 halves too little; fp8 is fp8)


@dataclass(frozen=True)
class Codec:
    """A compressed object row: `width` values (elements of the engine's row) in `group`s, one byte each, then a
    scale per group."""

    name: str
    width: int  # values per object row (the geometry's object width)
    group: int  # values per scale

    @property
    def groups(self) -> int:
        return self.width // self.group

    @property
    def row_bytes(self) -> int:
        """Bytes of one object row: the fp8 values, then the scales."""
        return self.width + self.groups * SCALE_BYTES


def codec_group(hs: int) -> int:
    """Values per scale for head size `hs`: the largest power of two dividing it, at most 128."""
    return min(hs & -hs, 128)


_coded: weakref.WeakKeyDictionary[KVGeometry, dict[str, KVGeometry]] = weakref.WeakKeyDictionary()


def with_codec(geom: KVGeometry, name: str) -> KVGeometry:
    """`geom` whose chunk objects are in codec `name` ("none": `geom` itself). The same coded geometry comes back
    for the same `geom` (copy plans are cached per geometry). ValueError saying why where the engine's cache
    cannot take the codec."""
    if name not in CODECS:
        raise ValueError(f"codec={name!r} is not one of {CODECS}")
    if name == "none" or (geom.codec is not None and geom.codec.name == name):
        return geom
    if geom.codec is not None:
        raise ValueError(f"this geometry's objects are in codec {geom.codec.name}, not {name}")
    per_geom = _coded.setdefault(geom, {})
    coded = per_geom.get(name)
    if coded is None:
        coded = per_geom[name] = dataclasses.replace(geom, codec=_fp8(geom))
    return coded


def coded_versions(geom: KVGeometry) -> list[KVGeometry]:
    """The coded geometries `with_codec` made of `geom` so far (their copy plans hold `geom`'s tensors too)."""
    return list(_coded.get(geom, {}).values())


def _fp8(geom: KVGeometry) -> Codec:
    if geom.dtype not in _ENGINE_DTYPES:
        why = "it is fp8 already" if geom.element_size == 1 else "fp8 objects are for bf16 and fp16 caches"
        raise ValueError(f"codec fp8 cannot take a {geom.dtype} KV cache: {why} (use codec none)")
    group = codec_group(geom.hs)
    if group < 16:
        raise ValueError(f"codec fp8 needs a head size that is a multiple of 16, got {geom.hs}")
    for s in geom.stripes:
        if s.w_offset % group or s.width % group:
            raise ValueError(
                f"codec fp8: {geom.fmt.name} splits object rows at column {s.w_offset} (+{s.width}), not at whole "
                f"groups of {group} values"
            )
    return Codec("fp8", geom.object_width, group)
