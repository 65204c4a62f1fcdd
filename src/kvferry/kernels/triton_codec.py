"""The fp8 codec inside the copy: a store's gather quantises, a retrieve's scatter dequantises (`triton_copy`).

Same arguments as `_stripe_copy_kernel` (so the launchers, the staging pipeline and the graphs are shared), but in
other units: engine offsets and strides count elements, object offsets and rows count bytes. Each (entry, token
tile) item walks its stripe GS groups at a time: a `[BLOCK_T tokens x GS groups x G values]` tile, a scale per token
and group, a token's GS scales written (or read) as one vector. The arithmetic is `kernels.codec.quantise_rows`'s,
operation for operation (IEEE divisions, round to nearest even), so the bytes equal the torch reference's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvferry.kernels.triton_tiling import PER_REQUEST


@triton.jit(do_not_specialize=PER_REQUEST)
def _stripe_codec_kernel(
    eng,
    eng_off,
    ent_row,
    obj_row,  # bytes per object row
    w_offset,  # where this stripe starts in the row, values
    block_stride,
    token_stride,
    tile_stride,
    s0,
    s1,
    s2,
    obj,
    obj_off,  # bytes
    obj_cap,
    ids,
    entry0,
    n_entries,
    row0,
    n_rows,
    chunk,
    obj_shift,  # bytes
    BS: tl.constexpr,
    TILE: tl.constexpr,
    F0: tl.constexpr,
    F1: tl.constexpr,
    F2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ENG_ALIGN: tl.constexpr,  # elements every engine token row's offset is a multiple of
    G: tl.constexpr,  # values per scale
    GS: tl.constexpr,  # groups per step: a tile is [BLOCK_T tokens x GS groups x G values], its scales one vector
    DATA: tl.constexpr,  # fp8 bytes of an object row; its scales follow
    TO_OBJECT: tl.constexpr,
    HAND_ROUND: tl.constexpr,  # round by hand (Triton's interpreter) rather than by the cast (a GPU's is RNE)
    DROP: tl.constexpr,  # the rounding to the stored float (fp8 for a store, the engine's dtype for a retrieve)
    MIN_NORMAL: tl.constexpr,
    SUB_STEP: tl.constexpr,
):
    obj_p = obj.to(tl.pointer_type(tl.uint8))
    WIDTH: tl.constexpr = F0 * F1 * F2
    tiles = (n_rows + BLOCK_T - 1) // BLOCK_T
    for item in tl.range(tl.program_id(0), n_entries * tiles, tl.num_programs(0)):
        entry = entry0 + item // tiles
        tile = item % tiles
        e_base = tl.load(eng_off + entry)
        row = tl.load(ent_row + entry)
        g = row0 + tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = g < row0 + n_rows
        o = g // chunk
        block = tl.load(ids + g // BS, mask=t_mask, other=0)
        o_base = tl.load(obj_off + o, mask=t_mask, other=0) + obj_shift
        cap = tl.load(obj_cap + o, mask=t_mask, other=0)
        o_tok = o_base + (row * cap + g % chunk) * obj_row  # the token's object row, bytes
        if TILE == BS:
            e_tok = e_base + block * block_stride + (g % BS) * token_stride
        else:
            e_tok = e_base + block * block_stride + (g % BS) // TILE * tile_stride + (g % TILE) * token_stride
        # what the plan knows of every offset and stride (loaded from tables, Triton cannot see it): the engine's
        # values move as vectors of up to 16 bytes rather than one by one
        e_tok = tl.multiple_of(e_tok, ENG_ALIGN)
        mask = t_mask[:, None]
        for k in tl.static_range(0, WIDTH // G, GS):
            w = k * G + tl.arange(0, GS * G)
            feat = (w // (F1 * F2)) * s0 + ((w // F2) % F1) * s1 + (w % F2) * s2
            e_ptr = eng + e_tok[:, None] + feat[None, :]
            d_ptr = obj_p + o_tok[:, None] + w_offset + w[None, :]
            # the step's GS scales, side by side in the row: one vector per token (4-byte stores cost a PCIe
            # transaction each where objects are host memory)
            s_col = DATA + (w_offset // G + k + tl.arange(0, GS)) * 4
            s_ptr = (obj_p + o_tok[:, None] + s_col[None, :]).to(tl.pointer_type(tl.float32))
            if TO_OBJECT:
                x = tl.reshape(tl.load(e_ptr, mask=mask).to(tl.float32), (BLOCK_T, GS, G))
                # tl.reduce with tl.max's own combine: `tl.max` is a jit function that Triton's interpreter cannot
                # call from a kernel interpreted on its own (CI's), and this is what its reduce recognises
                amax = tl.reduce(tl.abs(x), 2, tl.standard._elementwise_max)
                inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.where(amax > 0, amax, 1.0))
                inv = tl.where(amax > 0, inv, 0.0)  # an all-zero group (or a masked-off token): zeros, scale 0
                v = tl.reshape(tl.clamp(x * inv[:, :, None], -448.0, 448.0), (BLOCK_T, GS * G))
            else:
                q = tl.load(d_ptr, mask=mask).to(tl.float8e4nv, bitcast=True).to(tl.float32)
                scale = tl.load(s_ptr, mask=mask, other=0.0)
                v = tl.reshape(tl.reshape(q, (BLOCK_T, GS, G)) * scale[:, :, None], (BLOCK_T, GS * G))
            if HAND_ROUND:
                # `v` rounded to the narrower float by hand (DROP mantissa bits fewer; below MIN_NORMAL, multiples
                # of SUB_STEP; ties to even), so the cast after it is exact: Triton's interpreter, where CI runs
                # this kernel, rounds casts differently (float8 wrongly at binade edges, 31.8 -> 16; bf16 by
                # truncation). A GPU's casts round to nearest even themselves.
                bits = v.to(tl.int32, bitcast=True)
                v_normal = ((bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & -(1 << DROP)).to(
                    tl.float32, bitcast=True
                )
                a = tl.abs(v)
                v_sub = ((a * (1.0 / SUB_STEP) + 12582912.0) - 12582912.0) * SUB_STEP  # + 1.5 * 2**23: an integer
                # the sign by its bit: a GPU's `-x` is `0 - x`, which makes -0.0 of a tiny negative value +0.0
                v_sub = (v_sub.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
                v = tl.where(a < MIN_NORMAL, v_sub, v_normal)
            if TO_OBJECT:
                tl.store(d_ptr, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
                tl.store(s_ptr, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), mask=mask)
            else:
                tl.store(e_ptr, v.to(eng.dtype.element_ty), mask=mask)
