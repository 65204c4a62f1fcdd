"""How the copy kernel tiles a stripe, and the compile-time constants that follow (`triton_copy`'s kernel).

Kept apart from the kernel and its launchers: a pure function of the plan and the stripe, the one place that
decides tile shapes for the GPU (~32 KiB tiles) and for Triton's interpreter on CPU (few, large tiles).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kvferry.kernels.triton_copy import TritonPlan, _StripeArgs

_WORD_DTYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
# How the codec kernel rounds float32 to the float it stores: mantissa bits dropped, the smallest normal, the spacing
# of subnormals (bf16 has float32's exponent: its subnormals are float32's, rounded the same way).
_ROUNDING = {
    torch.float8_e4m3fn: dict(DROP=20, MIN_NORMAL=2.0**-6, SUB_STEP=2.0**-9),
    torch.bfloat16: dict(DROP=16, MIN_NORMAL=0.0, SUB_STEP=1.0),
    torch.float16: dict(DROP=13, MIN_NORMAL=2.0**-14, SUB_STEP=2.0**-24),
}
# The codec kernel's tile on a GPU, in values ([tokens x groups x values]: 4 x 8 x 128 for llama's 8 heads), the
# most groups one step takes (a stripe's groups, or its largest power-of-two divisor, up to this) and its warps per
# program: what the H200 figures in docs/codec.md ran with. `kvferry bench codec --sweep` tries others.
CODEC_TILE_VALUES = 4096
CODEC_GROUPS_PER_STEP = 8
CODEC_WARPS = 4
# Arguments that differ between requests (or engine caches) are never specialised: one compiled kernel is then
# valid for every request of a launch shape, and later launches skip Triton's per-call re-specialisation.
PER_REQUEST = ["eng_off", "ent_row", "obj_off", "obj_cap", "ids", "entry0", "n_entries", "row0", "n_rows", "chunk",
               "obj_shift"]  # fmt: skip


@dataclass(frozen=True)
class Tiling:
    flat: bool
    block_t: int  # tokens per tile
    block_w: int  # words per vector across a token row (row tiles; the codec: values per token and step)
    block_f: int  # words per flat vector (flat tiles)


def stripe_tiling(plan: TritonPlan, s: _StripeArgs, max_words: int, n_rows: int | None = None) -> Tiling:
    """How a stripe is tiled: [tokens x row words], or flat runs where that would waste vector lanes.

    Where a stripe covers whole object rows and a block's tokens lie back to back in the engine, BLOCK_T tokens of
    one block are one contiguous run on both sides; a row width that is not a power of two (deepseek's 576 bf16 =
    144 words, the indexer's 132 bytes = 33) would leave up to half the lanes of a [tokens x row] tile masked, so
    those stripes copy runs as flat vectors. BLOCK_T then divides BS (and so the chunk): a tile never crosses a
    block or an object.
    """
    if plan.codec is not None:  # [tokens x GS groups of values] tiles, a scale per token and group (`triton_codec`)
        groups = s.sizes[0] * s.sizes[1] * s.sizes[2] // plan.codec.group
        step = min(groups & -groups, CODEC_GROUPS_PER_STEP) * plan.codec.group  # values per token and step
        tokens = 256 if n_rows is None else triton.next_power_of_2(n_rows)
        values = CODEC_TILE_VALUES if n_rows is None else 2 * max_words
        return Tiling(False, max(1, min(tokens, values // step)), step, 1)
    f0, f1, f2 = s.sizes
    width = f0 * f1 * f2
    s0, s1, s2 = s.strides
    identity = (f2 == 1 or s2 == 1) and (f1 == 1 or s1 == f2) and (f0 == 1 or s0 == f1 * f2)  # word w is at w
    untiled = s.token_tile == plan.bs
    flat = identity and untiled and width == plan.obj_row and s.w_offset == 0 and s.token_stride == width
    flat = flat and bool(width & (width - 1))
    if flat:
        block_t = plan.bs & -plan.bs  # the largest power of two dividing BS
        while block_t > 1 and block_t * width > max_words:
            block_t //= 2
        return Tiling(True, block_t, 1, min(triton.next_power_of_2(block_t * width), max_words // 4))
    block_w = min(triton.next_power_of_2(width), max_words // 4)
    block_t = max(1, min(128 if n_rows is None else triton.next_power_of_2(n_rows), max_words // block_w))
    return Tiling(False, block_t, block_w, 1)


def launch_warps(plan: TritonPlan) -> int:
    """Warps per program (read at compile time: `kvferry bench codec --sweep` varies the codec's)."""
    return CODEC_WARPS if plan.codec is not None else 4


def kernel_constants(plan: TritonPlan, s: _StripeArgs, tiling: Tiling, to_objects: bool) -> dict[str, Any]:
    """The kernel's compile-time arguments for one stripe, direction and tiling."""
    if plan.codec is not None:
        return dict(
            BS=plan.bs, TILE=s.token_tile, F0=s.sizes[0], F1=s.sizes[1], F2=s.sizes[2], BLOCK_T=tiling.block_t,
            ENG_ALIGN=s.align, G=plan.codec.group, GS=tiling.block_w // plan.codec.group, DATA=plan.codec.width,
            TO_OBJECT=to_objects,
            HAND_ROUND=s.base.device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1",
            **_ROUNDING[torch.float8_e4m3fn if to_objects else s.base.dtype],
        )  # fmt: skip
    return dict(
        BS=plan.bs, TILE=s.token_tile, F0=s.sizes[0], F1=s.sizes[1], F2=s.sizes[2], WORD=_WORD_DTYPES[plan.word],
        BLOCK_T=tiling.block_t, BLOCK_W=tiling.block_w, TO_OBJECT=to_objects, FLAT=tiling.flat,
        BLOCK_F=tiling.block_f,
    )  # fmt: skip
