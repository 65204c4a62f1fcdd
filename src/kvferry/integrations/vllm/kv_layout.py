"""Recognise the KV cache vLLM hands to ``register_kv_caches`` and name it as a kvferry format.

Every backend but the CPU one hands over per-layer ``[B, H, N, C]`` views of one buffer, recognised from their
strides (`page_views`). vLLM's CPU backend (CPU_ATTN) gives one tensor per attention layer, ``[NB, NH, BS, 2*HS]``,
all views of one buffer; what each (block, head) holds depends on the attention ISA vLLM picked for the machine:

- ``vec`` / ``vec16``: K transposed (``[HS][BS]``), then V row-major (``[BS][HS]``): ``VLLM_CPU_NL_X_NB_NH_KT_V``;
- ``amx`` (Intel CPUs with AMX tiles, bf16 models): K in 16-token tiles with head-size pairs together, V in
  16-wide head-size tiles with token pairs together: ``VLLM_CPU_AMX_NL_X_NB_NH_KV_TILED``.

Both were read off vLLM 0.32's own ``cpu_attn_reshape_and_cache`` for bf16, fp16, fp32 and fp8 (uint8) caches
(tests/integrations/test_vllm_kv_layout.py checks them against it on every run). The ISAs of other architectures
(``neon``, ``vsx``, ``vxe``, ``rvv``) have not been checked: they are refused with the reason, never moved with a
guessed layout.

A tensor-parallel rank holds a slice of the model's KV heads (vLLM splits them evenly, or gives each rank one
head when there are fewer heads than ranks). kvferry's objects then hold every head and each rank moves its own
columns (`describe(..., heads=)`), so engines of any parallelism share one key space.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from kvferry.connector.engine_kv import EngineKV, UnsupportedKVLayout
from kvferry.formats import EngineKVFormat, describe
from kvferry.integrations.vllm.page_views import read_views

FORMAT_OF_ISA = {
    "vec": EngineKVFormat.VLLM_CPU_NL_X_NB_NH_KT_V,
    "vec16": EngineKVFormat.VLLM_CPU_NL_X_NB_NH_KT_V,
    "amx": EngineKVFormat.VLLM_CPU_AMX_NL_X_NB_NH_KV_TILED,
}
_KV_DTYPES = {"auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def refused_cache_dtype(cache_dtype: str) -> str | None:
    """Why kvferry does not move a KV cache of vLLM's ``cache_dtype`` (its ``--kv-cache-dtype``); None when it does.
    vLLM adds quantised caches (e.g. 0.33's ``octave_*``, ``turboquant_*``, ``nvfp4`` and dtypes a platform registers)
    whose bytes per token and scales no kvferry format describes: moved as guessed bytes they would corrupt KV."""
    if cache_dtype in _KV_DTYPES:
        return None
    return (
        f"vLLM's KV cache dtype is {cache_dtype!r}; kvferry moves {sorted(_KV_DTYPES)} caches only (a layout it "
        "does not know would be moved as guessed bytes)"
    )


def recognise(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    isa: str | None,
    kv_cache_dtype: str,
    tp: tuple[int, int] = (0, 1),
    model_kv_heads: int | None = None,
    mla: bool = False,
    block_size: int | None = None,
) -> EngineKV:
    """The format of ``kv_caches`` (vLLM's ``register_kv_caches`` argument); UnsupportedKVLayout otherwise.

    ``isa`` is the CPU attention ISA vLLM chose (``layer.isa``; None when the backend is not CPU_ATTN: vLLM's
    per-layer page views, on any device), ``kv_cache_dtype`` vLLM's ``cache_config.cache_dtype``, ``tp`` this
    worker's (rank, size) in its tensor-parallel group, ``model_kv_heads`` the model's KV heads (vLLM's
    ``get_total_num_kv_heads()``; None: the tensors hold them all), ``mla`` whether the model uses MLA and
    ``block_size`` the scheduler's (None: the tensors').
    """
    if not kv_caches:
        raise UnsupportedKVLayout("kv_caches is empty: the model has no attention layer with a KV cache")
    names = in_layer_order(list(kv_caches))
    layers = [kv_caches[n] for n in names]
    first = layers[0]
    if not all(isinstance(t, torch.Tensor) for t in layers):
        kinds = sorted({type(t).__name__ for t in layers})
        raise UnsupportedKVLayout(f"kv_caches values must be tensors, got {kinds}")
    quantised = kv_cache_dtype.startswith("fp8")
    dtype_fits = first.dtype == torch.uint8 if quantised else first.dtype in _FLOAT_DTYPES
    if kv_cache_dtype not in _KV_DTYPES or not dtype_fits:
        raise UnsupportedKVLayout(
            f"KV cache dtype {kv_cache_dtype!r} ({first.dtype}) is not supported; expected a bf16/fp16/fp32 cache "
            "or an fp8 one (uint8 tensors)"
        )
    kv_dtype = kv_cache_dtype if quantised else str(first.dtype).removeprefix("torch.")
    if isa is None:
        return _from_page_views(layers, names, kv_dtype, tp, model_kv_heads, mla, block_size)
    fmt = FORMAT_OF_ISA.get(str(isa))
    if fmt is None:
        raise UnsupportedKVLayout(
            f"vLLM's CPU attention ISA is {isa!r}; kvferry knows the KV layout of {sorted(FORMAT_OF_ISA)} only "
            "(checked against vLLM's own cache writes); moving another with a guessed layout would corrupt KV"
        )
    for name, t in zip(names, layers, strict=True):
        if t.dim() != 4 or t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise UnsupportedKVLayout(
                f"kv_caches[{name!r}] is {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}); expected "
                f"contiguous [NB, NH, BS, 2*HS] tensors like {tuple(first.shape)} {first.dtype} in every layer"
            )
    heads = rank_heads(int(first.shape[1]), model_kv_heads, *tp)
    try:
        describe(fmt, layers, heads=heads)
    except (TypeError, ValueError) as exc:
        raise UnsupportedKVLayout(f"vLLM's {isa!r} KV cache does not fit {fmt.name}: {exc}") from None
    bs = int(first.shape[2])
    if block_size is not None and block_size != bs:
        raise UnsupportedKVLayout(f"the KV tensors hold {bs}-token blocks but the scheduler uses {block_size}")
    return EngineKV(fmt, layers, layers, names, bs, kv_dtype, heads)


def _from_page_views(
    layers: list[torch.Tensor],
    names: list[str],
    kv_dtype: str,
    tp: tuple[int, int],
    model_kv_heads: int | None,
    mla: bool,
    block_size: int | None,
) -> EngineKV:
    views = read_views(layers, names, mla=mla)
    bs = views.block_tokens
    block_size = bs if block_size is None else block_size
    if block_size % bs:
        raise UnsupportedKVLayout(f"the KV views' {bs}-token blocks do not divide the scheduler's {block_size}")
    heads = None if mla else rank_heads(int(layers[0].shape[1]), model_kv_heads, *tp)
    try:
        describe(views.fmt, views.paged, heads=heads)
    except (TypeError, ValueError) as exc:
        raise UnsupportedKVLayout(f"vLLM's {views.order} KV views do not fit {views.fmt.name}: {exc}") from None
    return EngineKV(views.fmt, views.paged, layers, names, bs, kv_dtype, heads, views.order, block_size // bs)


def tensor_parallel_rank(vllm_config: Any) -> tuple[tuple[int, int], int | None]:
    """(this worker's (rank, size) in its tensor-parallel group, the model's KV heads when a rank may hold a slice
    of them: None without tensor parallelism, or with MLA's one latent head, which every rank keeps whole)."""
    size = vllm_config.parallel_config.tensor_parallel_size
    model = vllm_config.model_config
    if size == 1:
        return (0, 1), None
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    heads = None if getattr(model, "use_mla", False) else model.get_total_num_kv_heads()
    return (get_tensor_model_parallel_rank(), size), heads


def rank_heads(local: int, model: int | None, rank: int, size: int) -> tuple[int, int] | None:
    """(first head, the model's heads) of the ``local`` heads tensor-parallel rank ``rank`` of ``size`` holds;
    None when it holds every head. vLLM gives rank r heads ``r * local ..`` of an even split, and head
    ``r * model // size`` when there are fewer heads than ranks (replicas: each writes the same columns)."""
    if not 0 <= rank < size:
        raise UnsupportedKVLayout(f"tensor-parallel rank {rank} is not in a group of {size}")
    if model is None or local == model:
        return None
    if local * size == model or (local == 1 and model < size and size % model == 0):
        return rank * model // size, model
    raise UnsupportedKVLayout(
        f"this rank holds {local} KV heads of the model's {model} with tensor parallelism {size}: not vLLM's "
        "even split (or one head per rank)"
    )


def in_layer_order(names: list[str]) -> list[str]:
    """Sort by the layer index in each name ("model.layers.7.self_attn.attn" -> 7) when every name has one."""
    indices = {}
    for name in names:
        numbers = re.findall(r"\.(\d+)\.", f".{name}.")
        if len(numbers) != 1:
            return names
        indices[name] = int(numbers[0])
    return sorted(names, key=indices.__getitem__)
