"""vLLM's GPU KV caches as plain data: the cases, and their replay on any device without vLLM.

A case names an attention backend, a ``KVCacheLayout`` and a model shape. vLLM's own allocation code
(``allocate_kv_cache`` over a ``KVCacheConfig`` from ``get_kv_cache_config_from_groups``, see
tests/integrations/vllm_page_views.py) built each one, and `record` wrote what it built -- the buffer's size and
every layer view's dtype, shape, strides and offset -- into ``data/vllm_page_views.json``. The tests re-build every
case with vLLM and check the file, so it cannot drift from vLLM; a GPU machine without vLLM replays it (`replay`):
the connector's tests and ``kvferry bench vllm-gpu`` move KV in exactly the views a vLLM GPU engine registers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).parent / "data" / "vllm_page_views.json"
BENCH_TAG = "bench"  # the recorded cases of `BENCH_CASES`, model-sized
ALL_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
SPLITTABLE = ("LBHNC", "LBNHC")  # the layouts whose blocks are dense pages, which vLLM can split into kernel blocks


@dataclass(frozen=True)
class Case:
    """One KV cache as a vLLM engine would build it. ``kv_heads`` are this rank's; ``model_kv_heads`` the
    model's (tensor parallelism: rank ``tp[0]`` of ``tp[1]``). ``kernel_block`` forces vLLM's kernel block size
    (None: the backend's choice)."""

    backend: str
    layout: str
    dtype: str = "bfloat16"  # or "float16", "fp8" (vLLM's cache_dtype)
    mla: bool = False
    layers: int = 4
    kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    num_blocks: int = 12
    tp: tuple[int, int] = (0, 1)
    model_kv_heads: int | None = None
    kernel_block: int | None = None

    @property
    def name(self) -> str:
        parts = [self.backend, self.layout, self.dtype, f"L{self.layers}H{self.kv_heads}D{self.head_size}"]
        parts.append(f"bs{self.block_size}" + (f"k{self.kernel_block}" if self.kernel_block else ""))
        if self.tp[1] > 1:
            parts.append(f"tp{self.tp[0]}of{self.tp[1]}")
        return "-".join(parts)

    @property
    def cache_dtype(self) -> str:
        return "auto" if self.dtype in ("bfloat16", "float16") else self.dtype

    @property
    def model_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == "float16" else torch.bfloat16


# The GPU attention backends of vLLM 0.32 whose classes import without a GPU, and the layouts each accepts
# (`supported_kv_cache_layouts()`; None: any). FlashInfer needs the flashinfer package; FlashAttention-MLA and
# CUTLASS-MLA need CUDA to import.
BACKENDS = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend", False),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend", False),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend", False),
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend", True),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend", True),
}


def cases_for(backend: str, layouts: tuple[str, ...]) -> list[Case]:
    """The cases of one backend over the layouts it accepts."""
    mla = BACKENDS[backend][2]
    out: list[Case] = []
    for layout in layouts:
        if mla:
            # DeepSeek's latent (512 + 64 rope); FlashMLA's 64-token kernel blocks split a 128-token block where
            # the layout allows it (layer-compact), else vLLM keeps 64-token blocks.
            block = 128 if layout in SPLITTABLE else 64
            out.append(Case(backend, layout, mla=True, layers=3, kv_heads=1, head_size=576, block_size=block))
            out.append(Case(backend, layout, dtype="fp8", mla=True, layers=3, kv_heads=1, head_size=576,
                            block_size=block))  # fmt: skip
            continue
        out.append(Case(backend, layout))
        if backend == "FLASH_ATTN":
            out.append(Case(backend, layout, dtype="float16", kv_heads=1, head_size=128, layers=3))
            out.append(Case(backend, layout, dtype="fp8", num_blocks=9))
            for rank in range(2):
                out.append(Case(backend, layout, kv_heads=2, model_kv_heads=4, tp=(rank, 2)))
            if layout in SPLITTABLE:  # a kernel block smaller than the scheduler's
                out.append(Case(backend, layout, block_size=64, kernel_block=16, num_blocks=6))
    return out


# Model-sized KV caches for `kvferry bench vllm-gpu`: llama3-8b with FlashAttention in vLLM's first layout, with
# tokens outside heads, and in a cross-layer one, and DeepSeek-V3's MLA latent with FlashMLA; enough blocks for a
# 16-chunk prefix stored from one set of blocks and loaded into another (block 0, vLLM's null block, aside).
BENCH_CASES = [
    Case("FLASH_ATTN", "LBHNC", layers=32, kv_heads=8, head_size=128, block_size=16, num_blocks=560),
    Case("FLASH_ATTN", "LBNHC", layers=32, kv_heads=8, head_size=128, block_size=16, num_blocks=560),
    Case("FLASH_ATTN", "BLHNC", layers=32, kv_heads=8, head_size=128, block_size=16, num_blocks=560),
    Case("FLASHMLA", "LBHNC", mla=True, layers=61, kv_heads=1, head_size=576, block_size=64, num_blocks=140),
]


def record(case: Case, raw: torch.Tensor, views: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What vLLM built for ``case``: the raw buffer's size and each layer view's placement in it."""
    return {
        "case": asdict(case),
        "raw_bytes": raw.untyped_storage().nbytes(),
        "views": [
            {
                "name": name,
                "dtype": str(view.dtype).removeprefix("torch."),
                "shape": list(view.shape),
                "stride": list(view.stride()),
                "offset": view.storage_offset(),
            }
            for name, view in views.items()
        ],
    }


def load_fixtures() -> list[dict[str, Any]]:
    return json.loads(FIXTURES.read_text())


def case_of(fixture: dict[str, Any]) -> Case:
    fields = dict(fixture["case"])
    fields["tp"] = tuple(fields["tp"])
    return Case(**fields)


def replay(
    fixture: dict[str, Any], device: str | torch.device, allocate: Callable[[int], torch.Tensor] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A fresh int8 buffer on ``device`` (or of ``allocate(bytes)``: a uint8 tensor of at least that many bytes)
    and the recorded views of it, filled with random bytes."""
    raw = torch.randint(-128, 128, (fixture["raw_bytes"],), dtype=torch.int8, device=device)
    if allocate is not None:
        raw = allocate(fixture["raw_bytes"])[: fixture["raw_bytes"]].view(torch.int8).copy_(raw)
    views = {}
    for v in fixture["views"]:
        typed = raw.view(getattr(torch, v["dtype"]))
        views[v["name"]] = typed.as_strided(v["shape"], v["stride"], v["offset"])
    return raw, views
