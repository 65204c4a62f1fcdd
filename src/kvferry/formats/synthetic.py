"""Random engine KV caches in any declared layout, for tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvferry.formats.kinds import EngineKVFormat
from kvferry.formats.layouts import layout_of


@dataclass(frozen=True)
class ModelDims:
    """The sizes that decide a KV cache's shape (NP plane widths only for plane-split MLA layouts)."""

    nl: int
    nh: int
    hs: int
    plane_widths: tuple[int, ...] = ()


# Realistic shapes: kv heads x head size per layer.
MODELS: dict[str, ModelDims] = {
    "llama3-8b": ModelDims(nl=32, nh=8, hs=128),
    "qwen2.5-0.5b": ModelDims(nl=24, nh=2, hs=64),
    "deepseek-v3-mla": ModelDims(nl=61, nh=1, hs=576, plane_widths=(512, 64)),
}


def random_fill(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill with random, non-zero-heavy data of any dtype (integers and fp8 get random bytes)."""
    device = generator.device if generator is not None else t.device
    if t.dtype.is_floating_point and t.element_size() >= 2:
        if device == t.device:
            return t.normal_(generator=generator)  # in place: no float32 temporary (4x faster on CPU)
        return t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32, device=device))
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8, device=device))
    return t


def make_paged(
    fmt: EngineKVFormat | int,
    dims: ModelDims,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    *,
    one_buffer: bool = True,
    block_padding: int = 0,
    generator: torch.Generator | None = None,
) -> Any:
    """Build the engine's tensors for `fmt`, filled with random data (padding bytes too).

    `one_buffer` carves every tensor out of one allocation, layer outermost, as vLLM does; otherwise each tensor
    is its own allocation. `block_padding` adds elements after each block on the block axis when it is dim 0
    (the padded `stride(0)` of MLA pools).
    """
    fmt = EngineKVFormat(fmt)
    layout = layout_of(fmt)
    widths = dims.plane_widths if "NP" in layout.nesting else (dims.hs,)
    nested_sizes = {"NL": dims.nl, "TWO": 2, "NP": len(widths)}

    def shape_of(plane: int) -> list[int]:
        sizes = {
            "NL": dims.nl,
            "TWO": 2,
            "NB": num_blocks,
            "BS": block_size,
            "NBBS": num_blocks * block_size,
            "NH": dims.nh,
            "HS": widths[plane],
            "CS": 2 * dims.hs,
            "ONE": 1,
        }
        return [sizes[a] for a in layout.axes]

    count = 1
    for level in layout.nesting:
        count *= nested_sizes[level]
    pad = block_padding if layout.axes[0] in ("NB", "NBBS") else 0
    if pad and layout.axes[0] == "NBBS":
        raise ValueError("block padding needs the block axis (NB) first")

    def numel(shape: list[int]) -> int:
        inner = 1
        for s in shape[1:]:
            inner *= s
        return shape[0] * (inner + pad)

    planes_in_order = _leaf_planes(layout.nesting, nested_sizes)
    sizes_needed = [numel(shape_of(p)) for p in planes_in_order]
    buffer = torch.empty(sum(sizes_needed), dtype=dtype, device=device) if one_buffer else None
    leaves: list[torch.Tensor] = []
    offset = 0
    for plane, n in zip(planes_in_order, sizes_needed, strict=True):
        shape = shape_of(plane)
        flat = buffer[offset : offset + n] if buffer is not None else torch.empty(n, dtype=dtype, device=device)
        offset += n
        random_fill(flat, generator)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        if pad:
            strides[0] += pad
        leaves.append(flat.as_strided(shape, strides))
    return _nest(layout.nesting, nested_sizes, iter(leaves))


def _leaf_planes(nesting: tuple[str, ...], sizes: dict[str, int]) -> list[int]:
    """The NP plane index of every leaf tensor, in nesting order."""
    planes = [0]
    for level in nesting:
        n = sizes[level]
        planes = [i if level == "NP" else p for p in planes for i in range(n)]
    return planes


def _nest(nesting: tuple[str, ...], sizes: dict[str, int], leaves: Any) -> Any:
    if not nesting:
        return next(leaves)
    return [_nest(nesting[1:], sizes, leaves) for _ in range(sizes[nesting[0]])]
