"""One Triton kernel family for every layout: copy stripes between paged engine memory and chunk objects.

The kernel knows nothing about formats. It reads one stripe (see `kvferry.formats.geometry.Stripe`): a table of
(object plane, layer, engine offset) entries sharing one stride pattern, and copies tiles of
[BLOCK_T tokens x BLOCK_W words]. Data moves as integer words of the widest size (1-8 bytes) that every address,
stride and run is a multiple of, so dtype never matters (fp8 is just bytes).

Engine tensors of several allocations are addressed as word offsets from one base tensor, and objects likewise from
the first object: Triton only needs one pointer per side. On CPU tensors the same kernel runs in Triton's
interpreter (CI has no GPU).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from kvferry.formats import KVGeometry

_WORD_DTYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _stripe_copy_kernel(
    eng,  # any engine tensor: the base that entry offsets are relative to
    eng_off,  # int64 [E]: word offset of each entry's origin
    ent_row,  # int64 [E]: plane * NL + layer of each entry (its place in the object)
    obj,  # first object: the base of object offsets
    obj_off,  # int64 [n_objects]: word offset of each object
    obj_cap,  # int64 [n_objects]: token capacity of each object
    ids,  # int64 [n_block_ids]
    row0,  # first token (of the whole request) to copy: skip_prefix_blocks * BS
    n_rows,  # tokens to copy
    chunk,
    obj_row,  # words per object row (W)
    w_offset,  # where this stripe starts in the row, words
    block_stride,
    token_stride,
    s0,
    s1,
    s2,
    BS: tl.constexpr,
    F0: tl.constexpr,
    F1: tl.constexpr,
    F2: tl.constexpr,
    WORD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    TO_OBJECT: tl.constexpr,
):
    entry = tl.program_id(1)
    eng_p = eng.to(tl.pointer_type(WORD))
    obj_p = obj.to(tl.pointer_type(WORD))
    e_base = tl.load(eng_off + entry)
    row = tl.load(ent_row + entry)
    WIDTH: tl.constexpr = F0 * F1 * F2
    # A few programs per entry loop over the token tiles (grid-stride): the copy then holds only a small,
    # fixed number of SMs, which is what keeps the model's kernels running beside it.
    for tile in tl.range(tl.program_id(0), (n_rows + BLOCK_T - 1) // BLOCK_T, tl.num_programs(0)):
        g = row0 + tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = g < row0 + n_rows
        o = g // chunk
        block = tl.load(ids + g // BS, mask=t_mask, other=0)
        o_base = tl.load(obj_off + o, mask=t_mask, other=0)
        cap = tl.load(obj_cap + o, mask=t_mask, other=0)
        o_tok = o_base + (row * cap + g % chunk) * obj_row + w_offset
        e_tok = e_base + block * block_stride + (g % BS) * token_stride
        for w0 in tl.static_range(0, WIDTH, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            w_mask = w < WIDTH
            feat = (w // (F1 * F2)) * s0 + ((w // F2) % F1) * s1 + (w % F2) * s2
            mask = t_mask[:, None] & w_mask[None, :]
            e_ptr = eng_p + e_tok[:, None] + feat[None, :]
            o_ptr = obj_p + o_tok[:, None] + w[None, :]
            if TO_OBJECT:
                tl.store(o_ptr, tl.load(e_ptr, mask=mask), mask=mask)
            else:
                tl.store(e_ptr, tl.load(o_ptr, mask=mask), mask=mask)


@dataclass(frozen=True)
class _StripeArgs:
    """A stripe converted to word units, with its entry tables on the engine's device."""

    base: torch.Tensor
    eng_off: torch.Tensor
    ent_row: torch.Tensor
    w_offset: int
    block_stride: int
    token_stride: int
    sizes: tuple[int, int, int]
    strides: tuple[int, int, int]


@dataclass(frozen=True)
class TritonPlan:
    """Everything about one engine KV cache that does not change between requests (build once, reuse)."""

    bs: int
    width: int
    element_size: int
    bytes_per_token: int
    word: int
    stripes: tuple[_StripeArgs, ...]
    compiled: dict[tuple, Any] = field(default_factory=dict)  # launch shape -> compiled kernel


def _word_size(geom: KVGeometry) -> int:
    es = geom.element_size
    base = geom.stripes[0].tensors[0].data_ptr()
    quantities = [geom.width * es, base]
    for s in geom.stripes:
        quantities += [s.w_offset * es, s.block_stride * es, s.token_stride * es]
        inner_size, inner_stride = s.features[-1]
        quantities.append(inner_size * es if inner_stride == 1 else es)
        quantities += [stride * es for _, stride in s.features[:-1]]
        quantities += [t.data_ptr() - base + off * es for t, off in zip(s.tensors, s.offsets, strict=True)]
    g = math.gcd(*quantities)
    return max(w for w in (8, 4, 2, 1) if g % w == 0)


def build_plan(geom: KVGeometry) -> TritonPlan:
    word = _word_size(geom)
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
        args.append(
            _StripeArgs(
                base=base,
                eng_off=torch.tensor(off, dtype=torch.int64, device=geom.device),
                ent_row=torch.tensor(rows, dtype=torch.int64, device=geom.device),
                w_offset=s.w_offset * es // word,
                block_stride=s.block_stride * es // word,
                token_stride=s.token_stride * es // word,
                sizes=(feats[0][0], feats[1][0], feats[2][0]),
                strides=(feats[0][1], feats[1][1], feats[2][1]),
            )
        )
    # The plan holds no reference to the geometry: plans are cached per geometry, weakly.
    return TritonPlan(
        bs=geom.bs,
        width=geom.width,
        element_size=geom.element_size,
        bytes_per_token=geom.bytes_per_token,
        word=word,
        stripes=tuple(args),
    )


@cache
def _interpreted():  # type: ignore[no-untyped-def]
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_stripe_copy_kernel.fn)


def object_table(objects: list[torch.Tensor], word: int) -> torch.Tensor:
    """int64 [2, n]: word offset of each object from objects[0], and its token capacity (host tensor)."""
    base = objects[0].data_ptr()
    for i, o in enumerate(objects):
        if o.data_ptr() % word:
            raise ValueError(f"objects[{i}] is not {word}-byte aligned; allocate objects with {word}-byte alignment")
    return torch.tensor([[(o.data_ptr() - base) // word for o in objects], [o.shape[2] for o in objects]])


def launch(
    plan: TritonPlan,
    obj_base: torch.Tensor,
    table: torch.Tensor,
    block_ids: torch.Tensor,
    to_objects: bool,
    chunk_size: int,
    row0: int,
    n_rows: int,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Enqueue the copy of tokens [row0, row0 + n_rows) of a request on `stream` (default: the current one).

    `table` is `object_table(...)` on the engine's device, with offsets relative to `obj_base` (words); it may
    describe staging memory rather than the objects themselves. On CPU tensors the kernel is interpreted.
    """
    if n_rows <= 0:
        return
    interpret = block_ids.device.type != "cuda"
    obj_row = plan.width * plan.element_size // plan.word
    for index, s in enumerate(plan.stripes):
        width = s.sizes[0] * s.sizes[1] * s.sizes[2]
        block_w = min(triton.next_power_of_2(width), 4096 if interpret else 1024)
        block_t = _block_tokens(n_rows, block_w, interpret)
        tiles = triton.cdiv(n_rows, block_t)
        entries = len(s.eng_off)
        grid = (tiles if interpret else min(tiles, max(1, _programs(block_ids.device) // entries)), entries, 1)
        args = (
            s.base, s.eng_off, s.ent_row, obj_base, table[0], table[1], block_ids, row0, n_rows, chunk_size,
            obj_row, s.w_offset, s.block_stride, s.token_stride, *s.strides,
        )  # fmt: skip
        consts = dict(
            BS=plan.bs, F0=s.sizes[0], F1=s.sizes[1], F2=s.sizes[2], WORD=_WORD_DTYPES[plan.word],
            BLOCK_T=block_t, BLOCK_W=block_w, TO_OBJECT=to_objects,
        )  # fmt: skip
        if interpret:
            _interpreted()[grid](*args, **consts)
            continue
        handle = (stream or torch.cuda.current_stream()).cuda_stream
        key = (index, to_objects, block_t, block_w)
        fast = plan.compiled.get(key)
        if fast is None:  # first launch of this shape: through Triton's JIT (compiles, caches)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                compiled = _stripe_copy_kernel[grid](*args, **consts)
            plan.compiled[key] = _FastLaunch(compiled, tuple(consts.values()))
            continue
        # Later launches call the compiled kernel's launcher directly with raw pointers: Triton's JIT path
        # re-binds and re-specialises ~25 arguments on every call (~30 us), most of a small request's budget.
        table_ptr = table.data_ptr()
        fast(
            grid, handle,
            s.base.data_ptr(), s.eng_off.data_ptr(), s.ent_row.data_ptr(), obj_base.data_ptr(), table_ptr,
            table_ptr + table.stride(0) * 8, block_ids.data_ptr(), row0, n_rows, chunk_size, obj_row, s.w_offset,
            s.block_stride, s.token_stride, *s.strides,
        )  # fmt: skip


@dataclass(frozen=True)
class _FastLaunch:
    """A compiled kernel and its constexpr tail; calls the launcher as Triton's own JIT path does."""

    compiled: Any
    consts: tuple[Any, ...]

    def __call__(self, grid: tuple[int, int, int], stream: int, *args: Any) -> None:
        c = self.compiled
        full = (*args, *self.consts)
        enter, leave = _hook("launch_enter_hook"), _hook("launch_exit_hook")
        meta = c.launch_metadata(grid, stream, *full) if enter is not None else None
        c.run(grid[0], grid[1], grid[2], stream, c.function, c.packed_metadata, meta, enter, leave, *full)


@cache
def _programs(device: torch.device) -> int:
    """Programs per launch: two per SM, so a copy never floods the GPU (tiles are grid-strided)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _hook(name: str) -> object:
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs.runtime, name, None) if knobs is not None else None


def copy_triton(
    plan: TritonPlan,
    objects: list[torch.Tensor],
    block_ids: torch.Tensor,
    to_objects: bool,
    chunk_size: int,
    skip_prefix_blocks: int,
) -> None:
    """The whole request in one launch per stripe, kernel reading/writing the objects directly."""
    table = object_table(objects, plan.word).to(block_ids.device, non_blocking=True)
    bs = plan.bs
    n_rows = (len(block_ids) - skip_prefix_blocks) * bs
    launch(plan, objects[0], table, block_ids, to_objects, chunk_size, skip_prefix_blocks * bs, n_rows)


def _block_tokens(n_rows: int, block_w: int, interpret: bool) -> int:
    if interpret:  # the interpreter pays per program: few, large tiles
        return min(triton.next_power_of_2(n_rows), max(1, 65536 // block_w))
    return max(1, min(128, 4096 // block_w))  # ~32 KiB tiles of int64 words
