"""SGLang's device KV pools as plain data: the cases, and their replay on any device without SGLang.

A case names a pool class (MHA or MLA), a model shape and SGLang's page size. SGLang's own allocation code
(``MHATokenToKVPool`` / ``MLATokenToKVPool``, see tests/integrations/sglang_pool_checks.py) built each one, and
`record` wrote what it built -- each allocation's size and every layer buffer's dtype, shape, strides and offset in
its allocation -- into ``data/sglang_pools.json``. SGLang 0.5.23 puts a layer's K and V in the two halves of one
allocation (``[2, slots, heads, head dim]``); the record keeps that. The tests re-build every case with SGLang and
check the file, so it cannot drift from SGLang; a GPU machine without SGLang replays it (`replay`), so kvferry's
linker moves pages in exactly the buffers an SGLang GPU worker's pool holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).parent / "data" / "sglang_pools.json"
BENCH_TAG = "bench"  # the recorded cases of `BENCH_CASES`, model-sized


@dataclass(frozen=True)
class Case:
    """One device pool as an SGLang worker builds it: ``tokens`` slots (plus the padding page), ``page_size``
    tokens a page; MHA: ``kv_heads`` x ``head_dim`` for K and for V; MLA: rows of ``kv_lora_rank + rope_dim``."""

    kind: str  # "mha" or "mla"
    layers: int
    page_size: int
    tokens: int
    dtype: str = "bfloat16"
    kv_heads: int = 2
    head_dim: int = 8
    kv_lora_rank: int = 24
    rope_dim: int = 8
    tag: str = ""

    @property
    def name(self) -> str:
        shape = f"{self.kv_heads}x{self.head_dim}" if self.kind == "mha" else f"{self.kv_lora_rank}+{self.rope_dim}"
        return (
            f"{self.kind}-{self.layers}L-{shape}-page{self.page_size}-{self.dtype}{'-' + self.tag if self.tag else ''}"
        )


CASES = [
    Case("mha", layers=3, page_size=16, tokens=256),
    Case("mha", layers=2, page_size=1, tokens=64, dtype="float16"),  # SGLang's default page size
    Case("mla", layers=3, page_size=16, tokens=256),
]
# Llama-3-8B's KV and DeepSeek-V3's MLA latent in 64-token pages, slots for a 4096-token prefix stored from one set
# of pages and loaded into another.
BENCH_CASES = [
    Case("mha", layers=32, page_size=64, tokens=8192, kv_heads=8, head_dim=128, tag=BENCH_TAG),
    Case("mla", layers=61, page_size=64, tokens=8192, kv_lora_rank=512, rope_dim=64, tag=BENCH_TAG),
]


def record(case: Case, pool: Any) -> dict[str, Any]:
    """What SGLang built for ``case``: its class and layout, each allocation's size, and every buffer in them."""
    names = ("k_buffer", "v_buffer") if case.kind == "mha" else ("kv_buffer",)
    storages: dict[int, int] = {}  # an allocation's address -> its index
    sizes: list[int] = []
    buffers: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        for tensor in getattr(pool, name):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = len(sizes)
                sizes.append(storage.nbytes())
            buffers.setdefault(name, []).append(
                {
                    "storage": storages[storage.data_ptr()],
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "shape": list(tensor.shape),
                    "stride": list(tensor.stride()),
                    "offset": tensor.storage_offset(),
                }
            )
    return {
        "case": asdict(case),
        "class": type(pool).__name__,
        "attributes": {name: _plain(getattr(pool, name, None)) for name in _ATTRIBUTES},
        "storage_bytes": sizes,
        "buffers": buffers,
    }


# What kvferry's view of a pool (`kvferry.integrations.sglang.device_pages`) reads besides the buffers.
_ATTRIBUTES = ("page_size", "start_layer", "kv_cache_layout", "head_num", "head_dim", "v_head_dim", "k_scale_buffer",
               "v_scale_buffer")  # fmt: skip


def _plain(value: object) -> object:
    return value if value is None or isinstance(value, int | str) else repr(value)


def load_fixtures() -> list[dict[str, Any]]:
    return json.loads(FIXTURES.read_text())


def case_of(fixture: dict[str, Any]) -> Case:
    return Case(**fixture["case"])


def replay(fixture: dict[str, Any], device: str | torch.device) -> Any:
    """The recorded pool on ``device``: its allocations (uninitialised) and buffers in them, in an object of the
    recorded class's name with the attributes kvferry reads (no SGLang needed)."""
    storages = [torch.empty(n, dtype=torch.uint8, device=device).untyped_storage() for n in fixture["storage_bytes"]]
    pool = type(fixture["class"], (), {})()
    for name, value in fixture["attributes"].items():
        setattr(pool, name, value)
    for name, buffers in fixture["buffers"].items():
        setattr(pool, name, [_view(storages[b["storage"]], b, device) for b in buffers])
    return pool


def _view(storage: torch.UntypedStorage, buffer: dict[str, Any], device: str | torch.device) -> torch.Tensor:
    empty = torch.empty(0, dtype=getattr(torch, buffer["dtype"]), device=device)
    return empty.set_(storage, buffer["offset"], buffer["shape"], buffer["stride"])
