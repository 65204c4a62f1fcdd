"""Build a `page_view_cases.Case` with vLLM's own code, exactly as its GPU model runner does (needs vLLM).

The spec is the backend's (``customize_attention_spec``), the kernel block size vLLM's choice
(``select_common_block_size``, or none where block-outermost packing forbids splitting), the placement
``get_kv_cache_config_from_groups`` and the views ``allocate_kv_cache``: the tensors vLLM then hands to
``register_kv_caches``. Run as a script to rewrite the fixtures: ``python tests/integrations/vllm_page_views.py``.
"""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec, select_common_block_size

from kvferry.bench.vllm_views import ALL_LAYOUTS, BACKENDS, BENCH_CASES, FIXTURES, Case, cases_for, record


def backend_class(name: str) -> type:
    module, cls, _ = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def all_cases() -> list[Case]:
    out = []
    for name in BACKENDS:
        layouts = backend_class(name).supported_kv_cache_layouts()
        out += cases_for(name, tuple(m.name for m in layouts) if layouts else ALL_LAYOUTS)
    return out + BENCH_CASES


def build(case: Case, device: str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(vLLM's raw KV buffer, its per-layer views by layer name) for ``case``."""
    backend = backend_class(case.backend)
    layout = KVCacheLayout[case.layout]
    kv_dtype = torch.uint8 if case.dtype.startswith("fp8") else case.model_dtype
    if case.mla:
        spec = MLAAttentionSpec(
            block_size=case.block_size,
            num_kv_heads=1,
            head_size=case.head_size,
            dtype=kv_dtype,
            cache_dtype_str=case.cache_dtype,
        )
    else:
        spec = FullAttentionSpec(
            block_size=case.block_size, num_kv_heads=case.kv_heads, head_size=case.head_size, dtype=kv_dtype
        )
    spec = customize_attention_spec(backend, spec)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(case.layers)]
    group = KVCacheGroupSpec(names, spec)
    cache_config = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=case.num_blocks,
        prefix_cache_retention_interval=None,
    )
    vllm_config = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    config = get_kv_cache_config_from_groups(vllm_config, [group], available_memory=1 << 40)  # type: ignore[arg-type]
    if case.kernel_block is not None:
        kernel = case.kernel_block
    elif layout.is_block_outermost and case.layers > 1:
        kernel = spec.block_size  # other layers' pages lie between a block's kernel blocks: vLLM never splits
    else:
        kernel = select_common_block_size(spec.block_size, [backend], [spec])
    views = allocate_kv_cache(config, torch.device(device), layout, [kernel])
    first = views[names[0]]
    raw = torch.empty(0, dtype=torch.int8, device=first.device).set_(first.untyped_storage())
    return raw, {name: views[name] for name in names}


if __name__ == "__main__":
    fixtures = [record(case, *build(case)) for case in all_cases()]
    FIXTURES.parent.mkdir(exist_ok=True)
    FIXTURES.write_text(json.dumps(fixtures, indent=1) + "\n")
    print(f"{len(fixtures)} cases written to {FIXTURES}")
