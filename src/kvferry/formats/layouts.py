"""One declaration per engine KV layout.

A layout is data: how the engine nests its tensors (Python list levels) and the order of the axes inside each
tensor. Everything else -- sizes, strides, the chunk-object shape, validation, the copy kernels' arguments -- is
derived from these declarations by `kvferry.formats.geometry`. Adding a layout means adding one entry here.

Axis vocabulary
  NL    layers                     TWO   K and V (size 2)
  NB    blocks (pages)             BS    tokens per block
  NBBS  NB*BS token slots, block-major (the block size comes from the caller)
  NH    kv heads                   HS    head size (or per-token width for MLA planes)
  CS    K and V of one head fused: 2*HS elements, K first
  ONE   a size-1 axis that carries nothing
  NP    (nesting only) a tuple of planes whose widths add up to the per-token width

A TWO or CS axis that sits after NH keeps K and V interleaved per head, exactly as the engine stores them per token
("fused"): such layouts store one object plane of width NH*2*HS. Otherwise K and V are two object planes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvferry.formats.kinds import EngineKVFormat

NESTING_AXES = frozenset({"NL", "TWO", "NP"})
_TAIL_FACTOR = re.compile(r"(BS|HS)(?:([/%])([1-9][0-9]*))?")
TENSOR_AXES = frozenset({"NL", "TWO", "NB", "BS", "NBBS", "NH", "HS", "CS", "ONE"})


def tail_factor(name: str) -> tuple[str, str, int]:
    """`"BS/16"` -> ("BS", "outer", 16); `"BS%16"` -> ("BS", "inner", 16); `"BS"` -> ("BS", "whole", 1)."""
    match = _TAIL_FACTOR.fullmatch(name)
    if match is None:
        raise ValueError(f"split tail factor {name!r} is not BS, HS, BS/n, BS%n, HS/n or HS%n")
    axis, op, n = match.groups()
    return axis, {None: "whole", "/": "outer", "%": "inner"}[op], int(n or 1)


@dataclass(frozen=True)
class Layout:
    """The static facts of one engine layout.

    `split_tail`, when set, says that the memory of the two innermost axes of `axes` (BS, CS) does not follow their
    declared order: it holds the K plane then the V plane, each a block of BS*HS elements with its own order of
    *factors*, outermost first. A factor is `BS` or `HS` whole, or a tile split of one: `BS/16` (which tile of 16
    tokens) and `BS%16` (the token inside its tile), likewise for HS. vLLM's CPU backend keeps K transposed inside
    each block (`("HS", "BS")`), and its AMX ISA packs both planes in tiles. Strides inside the tail are derived
    from the sizes, which requires a contiguous tail.

    `element_sizes`, when set, are the only element sizes (bytes) the layout holds.
    """

    nesting: tuple[str, ...]
    axes: tuple[str, ...]
    engines: str
    element_sizes: tuple[int, ...] | None = None
    split_tail: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        unknown = (set(self.nesting) - NESTING_AXES) | (set(self.axes) - TENSOR_AXES)
        if unknown:
            raise ValueError(f"unknown axis names {sorted(unknown)} in layout declaration")
        if not ({"NB", "NBBS"} & set(self.axes)):
            raise ValueError("a layout needs a block axis (NB or NBBS)")
        for order in self.split_tail or ():
            factors = [tail_factor(f) for f in order]
            for axis in ("BS", "HS"):
                kinds = sorted((kind, n) for a, kind, n in factors if a == axis)
                whole = kinds == [("whole", 1)]
                split = len(kinds) == 2 and kinds[0][0] == "inner" and kinds[1] == ("outer", kinds[0][1])
                if not (whole or split):
                    raise ValueError(f"split tail {order}: {axis} must appear whole, or as {axis}/n and {axis}%n")

    def tail_multiple(self, axis: str) -> int:
        """What the size of `axis` (BS or HS) must be a multiple of: the tile its split tail cuts it into."""
        multiple = 1
        for order in self.split_tail or ():
            for a, _, n in map(tail_factor, order):
                multiple = math.lcm(multiple, n) if a == axis else multiple
        return multiple

    @property
    def fused(self) -> bool:
        """K and V interleaved per head inside each token (one object plane)."""
        if "CS" in self.axes and self.split_tail is None:
            return True
        return "TWO" in self.axes and "NH" in self.axes and self.axes.index("TWO") > self.axes.index("NH")

    @property
    def kv_size(self) -> int:
        has_two = "TWO" in self.nesting or "TWO" in self.axes or self.split_tail is not None
        return 2 if has_two and not self.fused else 1

    @property
    def is_mla(self) -> bool:
        return "NH" not in self.axes and self.kv_size == 1

    @property
    def is_hnd(self) -> bool:
        """Heads outside tokens inside a block: objects are transposed to token-major."""
        axes = self.axes
        return "NH" in axes and "BS" in axes and axes.index("NH") < axes.index("BS")

    @property
    def object_kind(self) -> str:
        """What a chunk object of this layout holds, in the cache's keys: ``kv`` (a K plane and a V plane), ``fused``
        (one plane, K and V interleaved per head) or ``plane`` (one plane: an MLA latent, or a single component).
        Layouts of one kind and object shape store the same bytes, so engines of different layouts share them."""
        if self.kv_size == 2:
            return "kv"
        return "fused" if self.fused else "plane"

    @property
    def is_cross_layer(self) -> bool:
        """All layers inside one tensor."""
        return "NL" in self.axes


F = EngineKVFormat
LAYOUTS: dict[EngineKVFormat, Layout] = {
    F.NB_NL_TWO_BS_NH_HS: Layout((), ("NB", "NL", "TWO", "BS", "NH", "HS"), "vLLM cross-layer blocks"),
    F.NL_X_TWO_NB_BS_NH_HS: Layout(("NL",), ("TWO", "NB", "BS", "NH", "HS"), "vLLM flash-attention (NHD)"),
    F.NL_X_NB_TWO_BS_NH_HS: Layout(("NL",), ("NB", "TWO", "BS", "NH", "HS"), "vLLM FlashInfer (NHD)"),
    F.NL_X_NB_BS_HS: Layout(("NL",), ("NB", "BS", "HS"), "vLLM MLA (DeepSeek)"),
    F.TWO_X_NL_X_NBBS_NH_HS: Layout(("TWO", "NL"), ("NBBS", "NH", "HS"), "SGLang MHA"),
    F.NL_X_NBBS_ONE_HS: Layout(("NL",), ("NBBS", "ONE", "HS"), "SGLang MLA"),
    F.NL_X_TWO_NB_NH_BS_HS: Layout(("NL",), ("TWO", "NB", "NH", "BS", "HS"), "vLLM flash-attention (HND)"),
    F.NL_X_NB_TWO_NH_BS_HS: Layout(("NL",), ("NB", "TWO", "NH", "BS", "HS"), "vLLM FlashInfer (HND)"),
    F.NB_NL_TWO_NH_BS_HS: Layout((), ("NB", "NL", "TWO", "NH", "BS", "HS"), "TRT-LLM cross-layer (HND)"),
    F.TWO_X_NL_X_NB_BS_NH_HS: Layout(("TWO", "NL"), ("NB", "BS", "NH", "HS"), "SGLang MHA via a server"),
    F.NL_X_NB_NH_BS_TWO_HS: Layout(("NL",), ("NB", "NH", "BS", "TWO", "HS"), "vLLM blocks-first fused (HND)"),
    F.NL_X_NB_BS_NH_TWO_HS: Layout(("NL",), ("NB", "BS", "NH", "TWO", "HS"), "vLLM blocks-first fused (NHD)"),
    F.NL_X_NB_NH_BS_CS: Layout(("NL",), ("NB", "NH", "BS", "CS"), "vLLM blocks-first fused, HND"),
    F.NL_X_NB_BS_NH_CS: Layout(("NL",), ("NB", "BS", "NH", "CS"), "vLLM blocks-first fused, NHD"),
    # Each page is [BS x 128 B fp8 values][BS x 4 B scales]; viewed as [NB, BS, 132] bytes, copying rows of the
    # view moves every page verbatim.
    F.NL_X_NB_BSV_BSS: Layout(("NL",), ("NB", "BS", "HS"), "DeepSeek V3.2/V4 indexer k-cache", element_sizes=(1,)),
    F.NL_X_TWO_NB_NH_ONE_BS_HS: Layout(("NL",), ("TWO", "NB", "NH", "ONE", "BS", "HS"), "vLLM-RBLN"),
    F.NL_X_TWO_X_NB_BS_NH_HS: Layout(("NL", "TWO"), ("NB", "BS", "NH", "HS"), "vLLM-Ascend"),
    F.NL_X_NP_X_NB_BS_ONE_HS: Layout(("NL", "NP"), ("NB", "BS", "ONE", "HS"), "vLLM-Ascend MLA"),
    F.NL_X_NB_BS_NH_HS: Layout(("NL",), ("NB", "BS", "NH", "HS"), "SGLang independent components"),
    F.NB_NL_NH_BS_CS: Layout((), ("NB", "NL", "NH", "BS", "CS"), "vLLM unified cross-layer, fused (HND)"),
    F.NB_NL_BS_NH_CS: Layout((), ("NB", "NL", "BS", "NH", "CS"), "vLLM unified cross-layer, fused (NHD)"),
    F.VLLM_CPU_NL_X_NB_NH_KT_V: Layout(
        ("NL",),
        ("NB", "NH", "BS", "CS"),
        "vLLM CPU backend (CPU_ATTN): K transposed inside each block",
        split_tail=(("HS", "BS"), ("BS", "HS")),
    ),
    # The AMX ISA keeps 16-token tiles of K with pairs of head-size elements together, and 16-element tiles of V's
    # head size with pairs of tokens together (checked against vLLM 0.32's cpu_attn_reshape_and_cache: bf16, fp16
    # and fp8 caches pack pairs; vLLM never picks AMX for fp32, whose tiles would not pair).
    F.VLLM_CPU_AMX_NL_X_NB_NH_KV_TILED: Layout(
        ("NL",),
        ("NB", "NH", "BS", "CS"),
        "vLLM CPU backend (CPU_ATTN), AMX ISA: K and V in AMX tiles inside each block",
        element_sizes=(1, 2),
        split_tail=(("BS/16", "HS/2", "BS%16", "HS%2"), ("HS/16", "BS/2", "HS%16", "BS%2")),
    ),
}


def layout_of(fmt: EngineKVFormat | int) -> Layout:
    try:
        return LAYOUTS[EngineKVFormat(fmt)]
    except ValueError:
        known = ", ".join(f"{f.value} ({f.name})" for f in EngineKVFormat)
        raise ValueError(f"fmt={fmt!r} is not a known EngineKVFormat; known: {known}") from None
