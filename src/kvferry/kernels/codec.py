"""The fp8 object codec in plain torch: the reference the Triton kernel is tested against, and the codec of the
reference and torch (CPU) backends.

`quantise_rows` / `dequantise_rows` turn rows of values `[..., W]` into compressed object rows `[..., row_bytes]`
and back (the layout: `kvferry.formats.codec`). `copy_coded` runs an exact copy backend through objects of the
engine's dtype, a batch of objects at a time, and quantises (store) or dequantises (retrieve) those: vectorised per
object, never per block or layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvferry.formats import Codec, KVGeometry
from kvferry.formats.codec import FP8_MAX, SCALE_BYTES

# copy(plain objects, block ids, to_objects, chunk_size, skip_prefix_blocks): an exact backend's copy
ExactCopy = Callable[[list[torch.Tensor], torch.Tensor, bool, int, int], None]
_BATCH_BYTES = 64 << 20  # of uncompressed objects held at once


def _scales(rows: torch.Tensor, codec: Codec, c0: int, c1: int) -> torch.Tensor:
    """The float32 scales of columns c0..c1 (whole groups) of compressed rows, as a view."""
    g = codec.group
    return rows[..., codec.width + c0 // g * SCALE_BYTES : codec.width + c1 // g * SCALE_BYTES].view(torch.float32)


def quantise_rows(values: torch.Tensor, codec: Codec, out: torch.Tensor, c0: int = 0, c1: int | None = None) -> None:
    """Write columns `c0..c1` (whole groups; default all) of `values [..., W]` into `out [..., row_bytes]` (uint8)."""
    c1 = codec.width if c1 is None else c1
    x = values[..., c0:c1].float().unflatten(-1, (-1, codec.group))
    amax = x.abs().amax(-1)
    # IEEE divisions, tensor by tensor (torch computes a number over a tensor as a reciprocal times it, and on CUDA a
    # tensor over a number likewise); an all-zero group stores zeros and scale 0.
    inv = torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax, 0.0)
    q = (x * inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out[..., c0:c1].copy_(q.flatten(-2).view(torch.uint8))
    _scales(out, codec, c0, c1).copy_(amax / torch.full_like(amax, FP8_MAX))  # (over a number: times 1/448 on CUDA)


def dequantise_rows(rows: torch.Tensor, codec: Codec, out: torch.Tensor, c0: int = 0, c1: int | None = None) -> None:
    """Write columns `c0..c1` of compressed `rows [..., row_bytes]` into `out [..., W]` (the engine's dtype)."""
    c1 = codec.width if c1 is None else c1
    q = rows[..., c0:c1].view(torch.float8_e4m3fn).float().unflatten(-1, (-1, codec.group))
    x = q * _scales(rows, codec, c0, c1).unsqueeze(-1)
    out[..., c0:c1].copy_(x.flatten(-2))


def copy_coded(
    copy: ExactCopy,
    geom: KVGeometry,
    objects: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    to_objects: bool,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> None:
    """`copy` (exact) between the engine and compressed `objects`, through uncompressed objects of up to 64 MiB."""
    codec = geom.codec
    assert codec is not None
    kv, nl, _, _ = geom.object_shape(chunk_size)
    c0 = geom.first_head * geom.width // geom.nh  # this engine's columns (a tensor-parallel rank's heads)
    c1 = c0 + geom.width
    per = chunk_size // geom.bs
    batch = max(1, _BATCH_BYTES // (kv * nl * chunk_size * codec.width * geom.element_size))
    for o0 in range(skip_prefix_blocks // per, len(objects), batch):  # objects wholly skipped are not touched
        objs = objects[o0 : o0 + batch]
        skip = max(0, skip_prefix_blocks - o0 * per)  # only the batch's first object can be partly skipped
        plain = [torch.empty((kv, nl, o.shape[2], codec.width), dtype=geom.dtype, device=o.device) for o in objs]
        ids = block_ids[o0 * per : (o0 + len(objs)) * per]
        if to_objects:
            copy(plain, ids, True, chunk_size, skip)
        for i, (obj, p) in enumerate(zip(objs, plain, strict=True)):
            t0 = skip * geom.bs if i == 0 else 0
            if to_objects:
                quantise_rows(p[:, :, t0:], codec, obj[:, :, t0:], c0, c1)
            else:
                dequantise_rows(obj[:, :, t0:], codec, p[:, :, t0:], c0, c1)
        if not to_objects:
            copy(plain, ids, False, chunk_size, skip)
