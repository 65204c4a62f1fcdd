"""What the connector reads of vLLM's own objects to recognise its KV: the attention backends and CPU ISA of the
layers (vLLM's forward context), the model's MLA and tensor-parallel facts, the served model's name; and the log
line that names what it recognised (`describe`).

`kv_layout.recognise` then turns the layers' tensors into the KV kvferry moves; this module only gathers its
arguments from a `VllmConfig`, so the connector stays a translation of vLLM's calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvferry.connector.backends import EmbeddedBackend
from kvferry.connector.engine_kv import EngineKV, UnsupportedKVLayout
from kvferry.connector.layer_parts import LayerSplitBackend
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.settings import ConnectorSettings
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


def describe(
    settings: ConnectorSettings,
    vllm_config: VllmConfig,
    kv_caches: dict[str, torch.Tensor],
    kv: EngineKV,
    isa: str | None,
    backend: EmbeddedBackend | ServerBackend | LayerSplitBackend,
    exact: Sequence[int],
    block_size: int,
) -> str:
    """The log line of a connector that registered ``kv`` (vLLM's ``kv_caches``, in blocks of ``block_size``)
    with ``backend`` (``exact``: the layers a layer split keeps exact)."""
    names = ", ".join([*sorted(backend_names(vllm_config, kv_caches)), *([f"CPU attention ISA {isa}"] if isa else [])])
    server = f" ({settings.server_url})" if settings.mode == "server" else ""
    layer = kv.layers[0]
    split = f" ({kv.split} kernel blocks of {kv.block_size})" if kv.split > 1 else ""
    chunk = backend.chunk_size if backend.chunk_size is not None else "the server's (not reached yet)"
    loads = "background" if settings.async_load else "foreground"
    exact_layers = f" (layers {exact} exact)" if isinstance(backend, LayerSplitBackend) else ""
    return (
        f"kvferry connector active: {settings.mode} mode{server}, {kv.kv_dtype} KV on {layer.device}, vLLM order "
        f"{kv.order} ({names}) as {kv.fmt.name}, {len(kv.layers)} layers of {tuple(layer.shape)} "
        f"{str(layer.dtype).removeprefix('torch.')}, block size {block_size}{split}, chunk size {chunk}, {loads} "
        f"loads, objects in codec {settings.objects_codec() or 'of the server'}{exact_layers}"
    )


def served_model_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
