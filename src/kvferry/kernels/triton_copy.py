"""One Triton kernel family for every layout: copy stripes between paged engine memory and chunk objects.

The kernel knows nothing about formats. It reads one stripe (see `kvferry.formats.geometry.Stripe`): a table of
(object plane, layer, engine offset) entries sharing one stride pattern, and copies tiles of
[BLOCK_T tokens x BLOCK_W words], or flat runs of BLOCK_T whole token rows where both sides hold them back to back
(`triton_tiling`). Data moves as integer words of the widest size (1-8 bytes) that every address, stride and run is a
multiple of, so dtype never matters (fp8 is just bytes).

Engine tensors of several allocations are addressed as word offsets from one base tensor, and objects likewise from
the first object: Triton only needs one pointer per side. On CPU tensors the same kernel runs in Triton's
interpreter (CI has no GPU).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from kvferry.cuda.driver import driver
from kvferry.formats import Codec, KVGeometry
from kvferry.formats.geometry import Stripe
from kvferry.kernels.direct_launch import active_hook, direct_launcher
from kvferry.kernels.triton_codec import _stripe_codec_kernel
from kvferry.kernels.triton_tiling import PER_REQUEST, kernel_constants, launch_warps, stripe_tiling


@triton.jit(do_not_specialize=PER_REQUEST)
def _stripe_copy_kernel(
    # per stripe (fixed for the life of the engine's KV cache)
    eng,  # any engine tensor: the base that entry offsets are relative to
    eng_off,  # int64 [E]: word offset of each entry's origin
    ent_row,  # int64 [E]: plane * NL + layer of each entry (its row in the object)
    obj_row,  # words per object row (W)
    w_offset,  # where this stripe starts in the row, words
    block_stride,
    token_stride,
    tile_stride,  # between tiles of TILE tokens (engines that pack tokens in tiles; unused when TILE == BS)
    s0,
    s1,
    s2,
    # per request
    obj,  # first object: the base of object offsets
    obj_off,  # int64 [n_objects]: word offset of each object
    obj_cap,  # int64 [n_objects]: token capacity of each object
    ids,  # int64 [n_block_ids]
    entry0,  # first entry of this launch (entries are sorted by object row)
    n_entries,
    row0,  # first token (of the whole request) to copy: skip_prefix_blocks * BS
    n_rows,  # tokens to copy
    chunk,
    obj_shift,  # words added to every object offset (places a slice of rows at the start of a staging slot)
    BS: tl.constexpr,
    TILE: tl.constexpr,
    F0: tl.constexpr,
    F1: tl.constexpr,
    F2: tl.constexpr,
    WORD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    TO_OBJECT: tl.constexpr,
    FLAT: tl.constexpr,  # tiles are contiguous runs on both sides: copy them as flat vectors (see `triton_tiling`)
    BLOCK_F: tl.constexpr,
):
    eng_p = eng.to(tl.pointer_type(WORD))
    obj_p = obj.to(tl.pointer_type(WORD))
    WIDTH: tl.constexpr = F0 * F1 * F2
    tiles = (n_rows + BLOCK_T - 1) // BLOCK_T
    # A fixed number of programs loops over (entry, token tile) items (grid-stride): the copy holds only a few
    # SMs, which is what keeps the model's kernels running beside it. Neighbouring items are neighbouring tiles
    # of one entry, so concurrent programs write neighbouring object bytes.
    for item in tl.range(tl.program_id(0), n_entries * tiles, tl.num_programs(0)):
        entry = entry0 + item // tiles
        tile = item % tiles
        e_base = tl.load(eng_off + entry)
        row = tl.load(ent_row + entry)
        if FLAT:  # BLOCK_T tokens of one block and one object, whole rows, tokens contiguous on both sides
            g0 = row0 + tile * BLOCK_T
            o0 = g0 // chunk
            o_run = tl.load(obj_off + o0) + obj_shift + (row * tl.load(obj_cap + o0) + g0 % chunk) * obj_row
            e_run = e_base + tl.load(ids + g0 // BS) * block_stride + (g0 % BS) * token_stride
            for f0 in tl.static_range(0, BLOCK_T * WIDTH, BLOCK_F):
                f = f0 + tl.arange(0, BLOCK_F)
                mask = (f < BLOCK_T * WIDTH) & (g0 + f // WIDTH < row0 + n_rows)
                if TO_OBJECT:
                    tl.store(obj_p + o_run + f, tl.load(eng_p + e_run + f, mask=mask), mask=mask)
                else:
                    tl.store(eng_p + e_run + f, tl.load(obj_p + o_run + f, mask=mask), mask=mask)
        else:
            g = row0 + tile * BLOCK_T + tl.arange(0, BLOCK_T)
            t_mask = g < row0 + n_rows
            o = g // chunk
            block = tl.load(ids + g // BS, mask=t_mask, other=0)
            o_base = tl.load(obj_off + o, mask=t_mask, other=0) + obj_shift
            cap = tl.load(obj_cap + o, mask=t_mask, other=0)
            o_tok = o_base + (row * cap + g % chunk) * obj_row + w_offset
            if TILE == BS:
                e_tok = e_base + block * block_stride + (g % BS) * token_stride
            else:
                e_tok = e_base + block * block_stride + (g % BS) // TILE * tile_stride + (g % TILE) * token_stride
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
                eng_off=torch.tensor([off[i] for i in order], dtype=torch.int64, device=geom.device),
                ent_row=torch.tensor([rows[i] for i in order], dtype=torch.int64, device=geom.device),
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
    )


def _kernel(plan: TritonPlan) -> Any:
    return _stripe_copy_kernel if plan.codec is None else _stripe_codec_kernel


@cache
def _interpreted(kernel: Any) -> Any:  # an InterpretedFunction: triton ships no types
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


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
    rows: tuple[int, int] | None = None,
    obj_shift: int = 0,
) -> None:
    """Copy tokens [row0, row0 + n_rows) of a request on the current stream (interpreted on CPU tensors).

    `table` is `object_table(...)` on the engine's device, with offsets relative to `obj_base` (words); it may
    describe staging memory rather than the objects themselves. `rows` and `obj_shift`: see `launch_raw`.
    """
    if n_rows <= 0:
        return
    if block_ids.device.type == "cuda":
        stream = torch.cuda.current_stream(block_ids.device).cuda_stream
        off = table.data_ptr()
        launch_raw(plan, stream, obj_base.data_ptr(), off, off + table.stride(0) * 8, block_ids.data_ptr(),
                   to_objects, chunk_size, row0, n_rows, rows, obj_shift)  # fmt: skip
        return
    obj_row = plan.obj_row
    for s in plan.stripes:
        e0, e1 = _entries(s, rows)
        if e1 == e0:
            continue
        tiling = stripe_tiling(plan, s, 65536, n_rows)  # the interpreter pays ~2 ms per program: few, large tiles
        grid = ((e1 - e0) * triton.cdiv(n_rows, tiling.block_t),)
        _interpreted(_kernel(plan))[grid](
            s.base, s.eng_off, s.ent_row, obj_row, s.w_offset, s.block_stride, s.token_stride,
            s.tile_stride, *s.strides,
            obj_base, table[0], table[1], block_ids, e0, e1 - e0, row0, n_rows, chunk_size, obj_shift,
            **kernel_constants(plan, s, tiling, to_objects),
        )  # fmt: skip


def launch_raw(
    plan: TritonPlan,
    stream: int,
    obj_ptr: int,
    off_ptr: int,
    cap_ptr: int,
    ids_ptr: int,
    to_objects: bool,
    chunk_size: int,
    row0: int,
    n_rows: int,
    rows: tuple[int, int] | None = None,
    obj_shift: int = 0,
    programs: int | None = None,
) -> None:
    """Enqueue a copy on a GPU stream (a raw handle), every table given as a device address.

    `rows=(r0, r1)` copies only object rows r0..r1-1 (plane * NL + layer), with `obj_shift` words added to every
    object offset: how the pipeline moves one large object through staging in slices. `programs` caps the grid
    (default: two per SM); the tiles are grid-strided over it.
    """
    if n_rows <= 0:
        return
    if not -(2**31) <= obj_shift < 2**31 or row0 + n_rows >= 2**31:
        raise ValueError("a launch's token range and staging shift must fit 32 bits (the kernel's argument types)")
    for index, s in enumerate(plan.stripes):
        e0, e1 = _entries(s, rows)
        if e1 == e0:
            continue
        key = (index, to_objects, obj_ptr % 16 == 0)
        fast = plan.compiled.get(key)
        if fast is None:  # first launch of this shape: compile (Triton caches it) without launching
            fast = plan.compiled[key] = _compile(plan, s, obj_ptr, to_objects)
        grid = min(triton.cdiv(n_rows, fast.block_t) * (e1 - e0), programs or fast.programs)
        fast.launch(grid, stream, obj_ptr, off_ptr, cap_ptr, ids_ptr, e0, e1 - e0, row0, n_rows, chunk_size, obj_shift)


def compile_all(plan: TritonPlan) -> None:
    """Compile every stripe's kernel for both directions now (objects 16-byte aligned, as the pool's and the staging
    slots are): a request's first use of one would otherwise pay Triton's compile, or its disk cache's load (5-200
    ms on the GPU host: the first RETRIEVE through a fresh server was its slowest request)."""
    for index, s in enumerate(plan.stripes):
        for to_objects in (True, False):
            key = (index, to_objects, True)
            if key not in plan.compiled:
                plan.compiled[key] = _compile(plan, s, 0, to_objects)


@dataclass(frozen=True)
class _FastLaunch:
    """A compiled kernel, its stripe's arguments and constexpr tail; calls Triton's launcher as its JIT path does.

    Triton's JIT path re-binds and re-specialises ~25 arguments on every call (~30 us on a slow host), most of a
    small request's budget. The per-request arguments are never specialised (`PER_REQUEST`), so one compiled
    kernel serves every request of its key. (`direct_launch` goes further where the kernel's ABI allows.)
    """

    compiled: Any
    head: tuple[Any, ...]
    consts: tuple[Any, ...]

    def __call__(self, grid: int, stream: int, *args: Any) -> None:
        c = self.compiled
        full = (*self.head, *args, *self.consts)
        enter, leave = active_hook("launch_enter_hook"), active_hook("launch_exit_hook")
        meta = c.launch_metadata((grid, 1, 1), stream, *full) if enter is not None else None
        c.run(grid, 1, 1, stream, c.function, c.packed_metadata, meta, enter, leave, *full)


@dataclass(frozen=True)
class _Launcher:
    """How one (stripe, direction, alignment) launches: direct when possible, else through Triton's launcher."""

    launch: Any  # launch(grid, stream, *per-request args)
    block_t: int
    programs: int


def _compile(plan: TritonPlan, s: _StripeArgs, obj_ptr: int, to_objects: bool) -> _Launcher:
    tiling = stripe_tiling(plan, s, 4096)  # ~32 KiB tiles of int64 words
    consts = kernel_constants(plan, s, tiling, to_objects)
    device = s.base.device
    # Stand-ins: the object base with the alignment the key promises (Triton specialises that pointer on it),
    # tables only 8-byte aligned (they are unspecialised; this keeps any Triton that still looks safe).
    obj = torch.empty(32, dtype=torch.uint8, device=device)[0 if obj_ptr % 16 == 0 else plan.word :]
    table = torch.zeros(5, dtype=torch.int64, device=device)[1:]
    obj_row = plan.obj_row
    head = (s.base.data_ptr(), s.eng_off.data_ptr(), s.ent_row.data_ptr(), obj_row, s.w_offset, s.block_stride,
            s.token_stride, s.tile_stride, *s.strides)  # fmt: skip
    kernel = _kernel(plan)
    with torch.cuda.device(device):
        compiled = kernel.warmup(
            s.base, s.eng_off, s.ent_row, obj_row, s.w_offset, s.block_stride, s.token_stride,
            s.tile_stride, *s.strides,
            obj, table, table, table, 0, 2, 0, 2, 2, 0, grid=(1,), num_warps=launch_warps(plan), **consts,
        )  # fmt: skip
        names = kernel.arg_names
        names = names[: names.index("obj_shift") + 1]  # the runtime arguments, in order
        direct = direct_launcher(driver(), compiled, names, list(head), len(names) - len(head))
    launch = direct or _FastLaunch(compiled, head, tuple(consts.values()))
    return _Launcher(launch, tiling.block_t, _programs(device, plan.codec is not None))


def _entries(s: _StripeArgs, rows: tuple[int, int] | None) -> tuple[int, int]:
    """The index range of a stripe's entries whose object row is in [rows[0], rows[1])."""
    return (0, len(s.rows)) if rows is None else (bisect_left(s.rows, rows[0]), bisect_left(s.rows, rows[1]))


@cache
def _programs(device: torch.device, coded: bool) -> int:
    """Programs per launch: two per SM, so a copy never floods the GPU (tiles are grid-strided). The codec's kernel
    gets eight: a GEMM beside 16-chunk fp8 stores and retrieves on the H200 kept 0.972-0.977 of its speed with eight
    per SM against 0.959-0.965 with two (four runs each)."""
    return (8 if coded else 2) * torch.cuda.get_device_properties(device).multi_processor_count


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
