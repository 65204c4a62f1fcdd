"""Recognise the KV cache vLLM hands to ``register_kv_caches`` and name it as a kvferry format.

vLLM's CPU backend (CPU_ATTN) gives one tensor per attention layer, ``[NB, NH, BS, 2*HS]``, all views of one
buffer; inside each (block, head) K is stored transposed (``[HS][BS]``) and V row-major (``[BS][HS]``): kvferry's
``VLLM_CPU_NL_X_NB_NH_KT_V``. That holds for the "vec" and "vec16" attention ISAs with a bf16/fp16/fp32 cache.
The "amx" ISA packs K and V into AMX tiles and other ISAs / fp8 caches are unverified: those are refused here
(the connector then stays out of the way) rather than moved with the wrong layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvferry.formats import EngineKVFormat

CPU_ISAS_WITH_SPLIT_KV = frozenset({"vec", "vec16"})
_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UnsupportedKVLayout(ValueError):
    """vLLM's KV cache is in a layout this connector does not move (the message says which and why)."""


@dataclass(frozen=True)
class EngineKV:
    """The engine's KV as kvferry sees it: the format, the per-layer tensors in layer order, the block size."""

    fmt: EngineKVFormat
    layers: list[torch.Tensor]
    layer_names: list[str]
    block_size: int


def recognise(kv_caches: Mapping[str, torch.Tensor], *, isa: str | None, kv_cache_dtype: str) -> EngineKV:
    """The format of ``kv_caches`` (vLLM's ``register_kv_caches`` argument); UnsupportedKVLayout otherwise.

    ``isa`` is the CPU attention ISA vLLM chose (``layer.isa``; None when the backend is not CPU_ATTN) and
    ``kv_cache_dtype`` vLLM's ``cache_config.cache_dtype``.
    """
    if not kv_caches:
        raise UnsupportedKVLayout("kv_caches is empty: the model has no attention layer with a KV cache")
    names = _in_layer_order(list(kv_caches))
    layers = [kv_caches[n] for n in names]
    first = layers[0]
    if not all(isinstance(t, torch.Tensor) for t in layers):
        kinds = sorted({type(t).__name__ for t in layers})
        raise UnsupportedKVLayout(f"kv_caches values must be tensors, got {kinds}")
    if first.device.type != "cpu":
        raise UnsupportedKVLayout(
            f"kv_caches are on {first.device}; this connector moves vLLM's CPU backend layout only"
        )
    if isa not in CPU_ISAS_WITH_SPLIT_KV:
        raise UnsupportedKVLayout(
            f"vLLM's CPU attention ISA is {isa!r}; the KV layout is known for {sorted(CPU_ISAS_WITH_SPLIT_KV)} "
            "only (the 'amx' ISA packs K/V in AMX tiles)"
        )
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32") or first.dtype not in _KV_DTYPES:
        raise UnsupportedKVLayout(
            f"KV cache dtype {kv_cache_dtype!r} ({first.dtype}) is not supported; expected a bf16/fp16/fp32 cache"
        )
    for name, t in zip(names, layers, strict=True):
        if t.dim() != 4 or t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise UnsupportedKVLayout(
                f"kv_caches[{name!r}] is {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}); expected "
                f"contiguous [NB, NH, BS, 2*HS] tensors like {tuple(first.shape)} {first.dtype} in every layer"
            )
    if first.shape[3] % 2:
        raise UnsupportedKVLayout(f"last dim {first.shape[3]} of the CPU KV cache must be 2*head_size (even)")
    return EngineKV(EngineKVFormat.VLLM_CPU_NL_X_NB_NH_KT_V, layers, names, int(first.shape[2]))


def _in_layer_order(names: list[str]) -> list[str]:
    """Sort by the layer index in each name ("model.layers.7.self_attn.attn" -> 7) when every name has one."""
    indices = {}
    for name in names:
        numbers = re.findall(r"\.(\d+)\.", f".{name}.")
        if len(numbers) != 1:
            return names
        indices[name] = int(numbers[0])
    return sorted(names, key=indices.__getitem__)
