"""A hybrid model's KV cache built with vLLM's own code, as its GPU model runner does under the hybrid KV cache
manager (needs vLLM): a sliding-window group (layers 0, 2) and a full-attention one (1, 3), whose layers share
vLLM's tensors; and a state-space hybrid: a Mamba group (layers 0, 2: a conv and an ssm state per block, in
pages padded to the attention layers' under vLLM's prefix caching, ``mamba_cache_mode "align"``) and a
full-attention one (1, 3). Recorded like `kvferry.bench.vllm_views` (plus each group's kind, window, page and
layers) so that a GPU machine without vLLM replays them: ``python tests/integrations/vllm_hybrid_views.py``
rewrites the fixtures. The replay tests share their devices and their check of the fixtures against vLLM here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvferry.bench.vllm_views import ALL_LAYOUTS, Case, record

HYBRID_FIXTURES = Path(__file__).resolve().parents[2] / "src/kvferry/bench/data/vllm_hybrid_views.json"
MAMBA_FIXTURES = HYBRID_FIXTURES.with_name("vllm_mamba_views.json")
WINDOW = 32
CASES = [Case("FLASH_ATTN", layout, num_blocks=48) for layout in ALL_LAYOUTS]
MAMBA_CASES = [Case("FLASH_ATTN", layout, block_size=64, num_blocks=24) for layout in ALL_LAYOUTS]
# A Mamba2-like state of a layer: conv state (kernel - 1, conv channels) in the model's dtype, then the ssm state
# (heads, head size, state size) in fp32; 4672 bytes, not a whole number of 64-byte rows.
MAMBA_SHAPES = ((3, 96), (4, 16, 16))
MAMBA_DTYPES = (torch.bfloat16, torch.float32)
# Where the fixtures are replayed: CPU tensors, and a CUDA device where there is one.
REPLAY_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


def recorded(fixtures: Path) -> list[dict[str, Any]]:
    """The cases recorded in ``fixtures`` (`HYBRID_FIXTURES` or `MAMBA_FIXTURES`)."""
    cases: list[dict[str, Any]] = json.loads(fixtures.read_text())
    return cases


def assert_recorded_as_vllm_builds(
    fixtures: list[dict[str, Any]], build_case: Callable[[Case], dict[str, Any]], cases: list[Case]
) -> None:
    """``fixtures`` are what ``build_case`` makes of ``cases`` with the vLLM installed (skips without vLLM)."""
    pytest.importorskip("vllm")
    assert json.loads(json.dumps([build_case(case) for case in cases])) == fixtures


def build(case: Case) -> dict[str, Any]:
    """The recorded views of ``case`` as a hybrid model (its ``groups``: kind, window and layer names)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.worker.utils import customize_attention_spec

    from tests.integrations.vllm_page_views import backend_class

    backend = backend_class(case.backend)
    common = {"block_size": case.block_size, "num_kv_heads": case.kv_heads, "head_size": case.head_size}
    common["dtype"] = case.model_dtype
    names = [f"model.layers.{i}.self_attn.attn" for i in range(case.layers)]
    sliding = customize_attention_spec(backend, SlidingWindowSpec(**common, sliding_window=WINDOW))
    full = customize_attention_spec(backend, FullAttentionSpec(**common))
    groups = [
        {"kind": "sliding_window", "window": WINDOW, "layers": names[0::2]},
        {"kind": "full", "window": 0, "layers": names[1::2]},
    ]
    return _allocate(case, [KVCacheGroupSpec(names[0::2], sliding), KVCacheGroupSpec(names[1::2], full)], groups)


def build_mamba(case: Case) -> dict[str, Any]:
    """The recorded views of ``case`` as a state-space hybrid (``groups``: kind, page bytes and layer names)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
    from vllm.v1.worker.utils import customize_attention_spec

    from tests.integrations.vllm_page_views import backend_class

    common = {"block_size": case.block_size, "num_kv_heads": case.kv_heads, "head_size": case.head_size}
    full = customize_attention_spec(backend_class(case.backend), FullAttentionSpec(**common, dtype=case.model_dtype))
    mamba = MambaSpec(
        block_size=case.block_size,
        shapes=MAMBA_SHAPES,
        dtypes=MAMBA_DTYPES,
        page_size_padded=full.page_size_bytes,  # vLLM pads a Mamba page to the attention layers' page
        mamba_cache_mode="align",
    )
    names = [f"model.layers.{i}.{'mixer' if i % 2 == 0 else 'self_attn.attn'}" for i in range(case.layers)]
    groups = [
        {"kind": "mamba", "page_bytes": mamba.page_size_bytes, "layers": names[0::2]},
        {"kind": "full", "page_bytes": 0, "layers": names[1::2]},
    ]
    return _allocate(case, [KVCacheGroupSpec(names[0::2], mamba), KVCacheGroupSpec(names[1::2], full)], groups)


def _allocate(case: Case, specs: list[Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's KV cache config and allocation for the group ``specs``, recorded with ``groups``."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    names = [name for group in groups for name in group["layers"]]
    layout = KVCacheLayout[case.layout]
    cache_config = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=case.num_blocks,
        prefix_cache_retention_interval=None,
    )
    vllm_config = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    config = get_kv_cache_config_from_groups(vllm_config, specs, available_memory=1 << 40)  # type: ignore[arg-type]
    views = allocate_kv_cache(config, torch.device("cpu"), layout, [case.block_size] * len(specs))
    first = views[names[0]]
    raw = torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())
    fixture = record(case, raw, {name: views[name] for name in sorted(names)})
    fixture["groups"] = groups
    return fixture


if __name__ == "__main__":
    HYBRID_FIXTURES.write_text(json.dumps([build(case) for case in CASES], indent=1) + "\n")
    MAMBA_FIXTURES.write_text(json.dumps([build_mamba(case) for case in MAMBA_CASES], indent=1) + "\n")
    print(f"{len(CASES)} + {len(MAMBA_CASES)} cases written to {HYBRID_FIXTURES} and {MAMBA_FIXTURES}")
