"""`kvferry bench transfer`: GB/s of `kvferry.transfer` on a model-shaped KV cache, as a ratio to a plain copy.

One case per (format, direction): an engine KV cache of `tokens / block_size` blocks in the format's layout
(random data), chunk objects carved from a `HostPool` (pinned when CUDA is available), and block ids in a random
permutation, so every block is somewhere else in the pool (scattered, as in a long-running engine). Before any
timing, the chosen backend's output on a slice of the request is checked byte for byte against the reference
backend: a fast but wrong backend is never reported. Timed runs alternate with the same-run copy ceiling
(`kvferry.bench.timing.CopyCeiling`), and both are reported as medians.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.bench.timing import CopyCeiling, gbps, time_call
from kvferry.formats import EngineKVFormat, KVGeometry, describe, layout_of
from kvferry.formats.synthetic import MODELS, ModelDims, make_paged, random_fill
from kvferry.memory import HostPool
from kvferry.transfer import Direction, transfer

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
DIRECTION_NAMES = {Direction.D2H: "d2h", Direction.H2D: "h2d"}
_VERIFY_OBJECTS = 2  # chunk objects' worth of blocks checked against the reference per case
_POISON = 0x5A


class BenchError(ValueError):
    """A benchmark that cannot run as asked (bad option) or whose backend disagrees with the reference."""


@dataclass(frozen=True)
class BenchSpec:
    """What to measure. Build it with `make_spec` to get the model defaults and validation."""

    model: str
    dims: ModelDims
    formats: tuple[EngineKVFormat, ...]
    directions: tuple[Direction, ...]
    tokens: int
    chunk_size: int
    block_size: int
    backend: str
    device: torch.device
    dtype: torch.dtype
    repeats: int
    seed: int = 0

    @property
    def steps(self) -> int:
        """Progress steps of a run: per case, one check against the reference, one warm-up, the repeats."""
        return len(self.formats) * len(self.directions) * (self.repeats + 2)


@dataclass
class TransferResult:
    fmt: EngineKVFormat
    direction: str
    backend: str
    dtype: str
    tokens: int
    nbytes: int
    seconds: list[float]
    ceiling_method: str
    ceiling_seconds: list[float]
    verified_blocks: int
    gbps: float = field(init=False)
    ceiling_gbps: float = field(init=False)
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        self.gbps = gbps(self.nbytes, statistics.median(self.seconds))
        self.ceiling_gbps = gbps(self.nbytes, statistics.median(self.ceiling_seconds))
        self.ratio = self.gbps / self.ceiling_gbps


def is_mla(dims: ModelDims) -> bool:
    return bool(dims.plane_widths)


def default_format(dims: ModelDims) -> EngineKVFormat:
    """vLLM's flash-attention layout for MHA/GQA models; vLLM's MLA layout for MLA models."""
    return EngineKVFormat.NL_X_NB_BS_HS if is_mla(dims) else EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def default_block_size(dims: ModelDims) -> int:
    """64-token blocks for MLA models (DeepSeek on vLLM), 16 otherwise."""
    return 64 if is_mla(dims) else 16


def parse_formats(text: str, dims: ModelDims) -> tuple[EngineKVFormat, ...]:
    """`all` (every layout of the model's attention kind), or comma-separated names or ids."""
    if text.strip().lower() == "all":
        return tuple(f for f in EngineKVFormat if layout_of(f).is_mla == is_mla(dims))
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(EngineKVFormat(int(item)) if item.isdigit() else EngineKVFormat[item.upper()])
        except (KeyError, ValueError):
            raise BenchError(
                f"--format {item!r} is not a format name or id (see `kvferry formats`), nor 'all'"
            ) from None
    return tuple(dict.fromkeys(out))


def kv_dtype(fmt: EngineKVFormat, dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine would hold for `fmt`: byte layouts (the fp8 indexer cache) move uint8."""
    sizes = layout_of(fmt).element_sizes
    if sizes is not None and dtype.itemsize not in sizes:
        return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[sizes[-1]]
    return dtype


def make_spec(
    *,
    model: str = "llama3-8b",
    layers: int | None = None,
    heads: int | None = None,
    head_size: int | None = None,
    formats: str | None = None,
    direction: str = "both",
    tokens: int = 4096,
    chunk_size: int = 256,
    block_size: int | None = None,
    backend: str = "auto",
    device: str = "cpu",
    dtype: str = "bf16",
    repeats: int = 7,
    seed: int = 0,
) -> BenchSpec:
    """Resolve model defaults and validate every option; raises BenchError naming the bad option."""
    if model not in MODELS:
        raise BenchError(f"--model {model!r} must be one of {sorted(MODELS)}")
    base = MODELS[model]
    dims = ModelDims(
        nl=layers if layers is not None else base.nl,
        nh=heads if heads is not None else base.nh,
        hs=head_size if head_size is not None else base.hs,
        # MLA plane widths add up to the head size; explicit head sizes make a plain (non-plane) cache.
        plane_widths=base.plane_widths if head_size is None else (),
    )
    for name, value in (("--layers", dims.nl), ("--heads", dims.nh), ("--head-size", dims.hs)):
        if value <= 0:
            raise BenchError(f"{name} must be positive, got {value}")
    named = model if (layers, heads, head_size) == (None, None, None) else f"custom({model})"
    fmts = parse_formats(formats, dims) if formats else (default_format(dims),)
    for fmt in fmts:
        if "NP" in layout_of(fmt).nesting and not dims.plane_widths:
            raise BenchError(f"--format {fmt.name} splits the KV into planes: it needs an MLA model's plane widths")
    dirs = {"d2h": (Direction.D2H,), "h2d": (Direction.H2D,), "both": (Direction.D2H, Direction.H2D)}
    if direction not in dirs:
        raise BenchError(f"--direction {direction!r} must be one of {sorted(dirs)}")
    bs = block_size if block_size is not None else default_block_size(dims)
    if bs <= 0:
        raise BenchError(f"--block-size must be positive, got {bs}")
    if chunk_size <= 0 or chunk_size % bs:
        raise BenchError(f"--chunk-size {chunk_size} must be a positive multiple of the block size {bs}")
    if tokens <= 0 or tokens % bs:
        raise BenchError(f"--tokens {tokens} must be a positive multiple of the block size {bs}")
    if repeats <= 0:
        raise BenchError(f"--repeats must be positive, got {repeats}")
    if dtype not in DTYPES:
        raise BenchError(f"--dtype {dtype!r} must be one of {sorted(DTYPES)}")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise BenchError(f"--device {device!r} must be cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch.cuda.is_available() is False")
    if dev.type == "cuda" and backend in ("torch", "reference"):
        raise BenchError(
            f"--backend {backend} moves between tensors of one device; on cuda the objects are pinned host memory: "
            "use --backend auto or triton"
        )
    return BenchSpec(
        model=named,
        dims=dims,
        formats=fmts,
        directions=dirs[direction],
        tokens=tokens,
        chunk_size=chunk_size,
        block_size=bs,
        backend=backend,
        device=dev,
        dtype=DTYPES[dtype],
        repeats=repeats,
        seed=seed,
    )


@dataclass
class _Case:
    """One format's engine cache, its chunk objects and the request's block ids."""

    fmt: EngineKVFormat
    paged: Any
    geom: KVGeometry
    objects: list[torch.Tensor]  # views into a HostPool's slab, which they keep alive
    block_ids: torch.Tensor
    tokens: int
    chunk_size: int

    @property
    def nbytes(self) -> int:
        return self.tokens * self.geom.bytes_per_token

    def run(self, direction: Direction, backend: str, objects: list[torch.Tensor] | None = None) -> None:
        objs = self.objects if objects is None else objects
        n_blocks = sum(o.shape[2] for o in objs) // self.geom.bs
        transfer(
            self.paged,
            objs,
            self.block_ids[:n_blocks],
            direction,
            self.fmt,
            chunk_size=self.chunk_size,
            backend=backend,
            block_size=self.geom.bs,
            geometry=self.geom,
        )


def _build_case(spec: BenchSpec, fmt: EngineKVFormat, generator: torch.Generator) -> _Case:
    num_blocks = spec.tokens // spec.block_size
    dtype = kv_dtype(fmt, spec.dtype)
    paged = make_paged(fmt, spec.dims, num_blocks, spec.block_size, dtype, spec.device, generator=generator)
    geom = describe(fmt, paged, spec.block_size)
    sizes = [min(spec.chunk_size, spec.tokens - start) for start in range(0, spec.tokens, spec.chunk_size)]
    shapes = [geom.object_shape(n) for n in sizes]
    alignment = 4096
    capacity = sum(math.ceil(math.prod(s) * geom.element_size / alignment) * alignment for s in shapes)
    pool = HostPool(capacity, alignment=alignment)
    objects = [pool.alloc(s, dtype) for s in shapes]
    block_ids = torch.randperm(num_blocks, generator=generator)
    return _Case(fmt, paged, geom, objects, block_ids, spec.tokens, spec.chunk_size)


def _check_against_reference(case: _Case, direction: Direction, backend: str, generator: torch.Generator) -> int:
    """Run `backend` on the first objects of the request and compare with the reference; returns blocks checked."""
    objs = case.objects[:_VERIFY_OBJECTS]
    fresh = [torch.empty(o.shape, dtype=o.dtype, device=case.geom.device) for o in objs]
    for o in fresh:
        o.view(torch.uint8).fill_(_POISON)
    if direction is Direction.D2H:
        for o in objs:
            o.view(torch.uint8).fill_(_POISON)
        case.run(Direction.D2H, backend, objs)
    else:
        for o in objs:
            random_fill(o, generator)
        case.run(Direction.H2D, backend, objs)
    case.run(Direction.D2H, "reference", fresh)  # what the engine holds now, read by the oracle
    for i, (got, want) in enumerate(zip(objs, fresh, strict=True)):
        if not torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu()):
            raise BenchError(
                f"backend={backend!r} disagrees with the reference on {case.fmt.name} "
                f"{DIRECTION_NAMES[direction]} (object {i}): not timing a wrong result"
            )
    return sum(o.shape[2] for o in objs) // case.geom.bs


def run_bench(spec: BenchSpec, on_step: Callable[[str], None] | None = None) -> list[TransferResult]:
    """Measure every (format, direction) of `spec`; `on_step(description)` is called after each step."""
    step = on_step or (lambda _description: None)
    generator = torch.Generator().manual_seed(spec.seed)
    ceilings: dict[tuple[str, int], CopyCeiling] = {}
    results: list[TransferResult] = []
    for fmt in spec.formats:
        case = _build_case(spec, fmt, generator)
        # Fill the objects (page faults, and data for a retrieve) with one unmeasured store.
        case.run(Direction.D2H, spec.backend)
        for direction in spec.directions:
            name = DIRECTION_NAMES[direction]
            # On the CPU both directions copy host to host: one ceiling serves both.
            key = (name if spec.device.type == "cuda" else "host", case.nbytes)
            if key not in ceilings:
                ceilings[key] = CopyCeiling(spec.device, case.nbytes, name)
            results.append(_measure(spec, case, direction, ceilings[key], step, generator))
    return results


def _measure(
    spec: BenchSpec,
    case: _Case,
    direction: Direction,
    ceiling: CopyCeiling,
    step: Callable[[str], None],
    generator: torch.Generator,
) -> TransferResult:
    """Check one case against the reference, warm up, then alternate timed transfers with the ceiling copy."""
    label = f"{case.fmt.name} {DIRECTION_NAMES[direction]}"
    checked = _check_against_reference(case, direction, spec.backend, generator)
    step(f"{label}: checked against the reference")
    case.run(direction, spec.backend)
    ceiling.time_once()
    ceiling.clear()
    step(f"{label}: warm-up")
    seconds = []
    for r in range(spec.repeats):
        seconds.append(time_call(lambda: case.run(direction, spec.backend), spec.device))
        ceiling.time_once()
        step(f"{label}: run {r + 1}/{spec.repeats}")
    method, _ = ceiling.best()
    return TransferResult(
        fmt=case.fmt,
        direction=DIRECTION_NAMES[direction],
        backend=_resolved_backend(spec),
        dtype=str(case.geom.dtype).removeprefix("torch."),
        tokens=case.tokens,
        nbytes=case.nbytes,
        seconds=seconds,
        ceiling_method=method,
        ceiling_seconds=list(ceiling.samples[method]),
        verified_blocks=checked,
    )


def _resolved_backend(spec: BenchSpec) -> str:
    if spec.backend != "auto":
        return spec.backend
    return "triton" if spec.device.type == "cuda" else "torch"
