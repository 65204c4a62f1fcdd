"""What the connector reads of vLLM's own objects to recognise its KV: the attention backends and CPU ISA of the
layers (vLLM's forward context), the model's MLA and tensor-parallel facts, the served model's name.

`kv_layout.recognise` then turns the layers' tensors into the KV kvferry moves; this module only gathers its
arguments from a `VllmConfig`, so the connector stays a translation of vLLM's calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvferry.connector.engine_kv import EngineKV, UnsupportedKVLayout
from kvferry.integrations.vllm.kv_layout import recognise, tensor_parallel_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def attention_isa(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> str | None:
    """The CPU attention ISA of vLLM's CPU backend (it packs K and V inside each page its own way) for the
    attention layers holding ``kv_caches``; None for every other backend, whose per-layer views are read from
    their strides."""
    layers = vllm_config.compilation_config.static_forward_context
    isas = {getattr(layers.get(name), "isa", None) for name in kv_caches}
    if len(isas) != 1:
        raise UnsupportedKVLayout(f"attention layers use different CPU ISAs {sorted(map(str, isas))}")
    isa = isas.pop()
    if isa is None and "CPU_ATTN" in backend_names(vllm_config, kv_caches):
        raise UnsupportedKVLayout("vLLM's CPU attention layers name no ISA: their pages' packing is unknown")
    return isa


def backend_names(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> set[str]:
    """The attention backends of the layers holding ``kv_caches`` (for messages, and to tell CPU_ATTN apart)."""
    layers = vllm_config.compilation_config.static_forward_context
    names = set()
    for name in kv_caches:
        backend = getattr(layers.get(name), "attn_backend", None)
        names.add(
            backend.get_name()
            if backend is not None and hasattr(backend, "get_name")
            else type(layers.get(name)).__name__
        )
    return names


def recognise_vllm_kv(
    vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor], isa: str | None, block_size: int
) -> EngineKV:
    """``kv_caches`` (layers of one block size) as KV kvferry moves, with the model's facts from ``vllm_config``."""
    mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    if mla and _on_cpu():
        raise UnsupportedKVLayout(
            "vLLM's CPU MLA attention cannot compute a prompt's rest over a prefix it did not compute itself "
            "(vLLM turns prefix caching and chunked prefill off for MLA on a CPU); a loaded prefix would give "
            "other tokens"
        )
    tp, model_kv_heads = tensor_parallel_rank(vllm_config)
    return recognise(
        kv_caches,
        isa=isa,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        tp=tp,
        model_kv_heads=model_kv_heads,
        mla=mla,
        block_size=block_size,
    )


def served_model_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
