"""What `kvferry bench transfer` runs: its options resolved against a model's shape and checked before it runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.bench.harness import BenchError
from kvferry.formats import EngineKVFormat, layout_of
from kvferry.formats.synthetic import MODELS, ModelDims
from kvferry.transfer import Direction
from kvferry.transfer.api import Backend

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


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
    backend: Backend
    device: torch.device
    dtype: torch.dtype
    repeats: int
    seed: int = 0

    @property
    def steps(self) -> int:
        """Progress steps of a run: per case, one check against the reference, one warm-up, the repeats."""
        return len(self.formats) * len(self.directions) * (self.repeats + 2)


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
    backend: Backend = "auto",
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
