"""Every device pool of an SGLang model the unified-cache linker moves, without importing SGLang: the pool names
SGLang's transfers carry (``PoolName``'s values), each pool's objects and how its device indices map to blocks.

=============================  ==================================================  =============================
SGLang's cache                 pools                                               objects a page (or a state)
=============================  ==================================================  =============================
MHA / MLA (``FULL``)           ``kv``: the token pool (`device_pages`)             one page object
SWA (``FULL`` + ``SWA``)       ``kv``: the full layers' pool; ``swa``: the         one page object in each
                               sliding-window layers' pool (both MHA pools of
                               their own slots: ``SWAKVPool``)
Mamba (``FULL`` + ``MAMBA``)   ``kv``: the full layers' pool; ``mamba``: each      one page object; one object
                               request's recurrent state (``MambaPool``: per       per state tensor (temporal,
                               layer a temporal and conv states, one slot a        each conv) of a slot
                               request)
=============================  ==================================================  =============================

A state slot's bytes move as one block of ``page_size`` rows (`state_groups.state_kv`, as a vLLM Mamba group's
do), so every object is a chunk of the page size. Each pool's objects have a key space of their own (its group tag:
the pool, and for a state the tensor), beside the ``kv`` pool's, which is the HiCache backend's too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvferry.connector.engine_kv import EngineKV, UnsupportedKVLayout
from kvferry.connector.state_groups import state_kv
from kvferry.formats import EngineKVFormat
from kvferry.integrations.sglang.device_pages import device_kv

KV, SWA, MAMBA = "kv", "swa", "mamba"  # SGLang's PoolName values


@dataclass(frozen=True)
class PoolObjects:
    """One kind of object of a pool: the KV kvferry moves, and its group tag in cache keys (None: the ``kv`` pool's,
    shared with the HiCache backend)."""

    kv: EngineKV
    group: str | None
    positions: tuple[int, ...]  # each of ``kv.layers``' place in the forward's layer order (the layer counter's)
    state: bool = False  # opaque bytes: kept exact whatever the codec


@dataclass(frozen=True)
class LinkedPool:
    """A device pool the linker moves: its objects, and how many of its device indices make one block (the page
    size for a token pool, 1 for a state pool, whose index is a slot)."""

    name: str
    objects: tuple[PoolObjects, ...]
    indices_per_block: int


@dataclass(frozen=True)
class DevicePools:
    pools: dict[str, LinkedPool]
    num_layers: int  # the model's layers on this stage: what SGLang's forward waits for, layer by layer
    mla: bool


def device_pools(kvcache: Any, req_to_token_pool: Any, page_size: int) -> DevicePools:
    """The pools of SGLang's device KV cache ``kvcache`` (``token_to_kv_pool_allocator.get_kvcache()``) and, for a
    Mamba hybrid, its request pool's states; UnsupportedKVLayout naming what is not moved."""
    kind = type(kvcache).__name__
    start = int(getattr(kvcache, "start_layer", 0))  # the forward waits for layer ``id - start``
    if kind == "SWAKVPool":
        in_pools = sorted(kvcache.layers_mapping.items(), key=lambda item: item[1])  # id -> (index in its pool, swa)
        full_ids, swa_ids = ([i for i, (_, swa) in in_pools if swa == side] for side in (False, True))
        full, swa = device_kv(kvcache.full_kv_pool, full_ids), device_kv(kvcache.swa_kv_pool, swa_ids)
        pools = [
            _token_pool(KV, full, None, page_size, [i - start for i in full_ids]),
            _token_pool(SWA, swa, SWA, page_size, [i - start for i in swa_ids]),
        ]
        return DevicePools({p.name: p for p in pools}, int(kvcache.layer_num), _mla(full))
    if kind == "HybridLinearKVPool":
        full_layers = sorted(kvcache.full_attention_layer_id_mapping, key=kvcache.full_attention_layer_id_mapping.get)
        full = device_kv(kvcache.full_kv_pool, full_layers)
        states = mamba_states(req_to_token_pool, page_size, start)
        last = max([*full_layers, *req_to_token_pool.mamba_map]) + 1 - start
        pools = [_token_pool(KV, full, None, page_size, [i - start for i in full_layers]), LinkedPool(MAMBA, states, 1)]
        return DevicePools({p.name: p for p in pools}, last, _mla(full))
    kv = device_kv(kvcache)
    return DevicePools({KV: kv_pool(kv)}, len(kv.layers), _mla(kv))


def _mla(kv: EngineKV) -> bool:
    """An MLA pool's: every tensor-parallel rank holds the same pages."""
    return kv.fmt == EngineKVFormat.NL_X_NBBS_ONE_HS


def kv_pool(kv: EngineKV) -> LinkedPool:
    """The ``kv`` pool of a model whose cache is ``kv`` alone (SGLang's MHA or MLA device pool)."""
    return _token_pool(KV, kv, None, kv.block_size, range(len(kv.layers)))


def _token_pool(name: str, kv: EngineKV, group: str | None, page_size: int, positions: Sequence[int]) -> LinkedPool:
    if kv.block_size != page_size:
        raise UnsupportedKVLayout(f"{name} device pages of {kv.block_size} tokens, not --page-size {page_size}")
    return LinkedPool(name, (PoolObjects(kv, group, tuple(positions)),), page_size)


def mamba_states(req_to_token_pool: Any, page_size: int, start_layer: int = 0) -> tuple[PoolObjects, ...]:
    """The state objects of SGLang's Mamba pool (each state tensor's layers as rows of one block a slot; in the
    forward, layer ``id - start_layer``). Refused: a pool whose slot ids are not its rows (unified memory), and the
    side states kvferry does not move (int8 checkpoints, short-conv and n-gram states)."""
    kind = type(req_to_token_pool).__name__
    if kind != "HybridReqToTokenPool":
        raise UnsupportedKVLayout(f"kvferry's SGLang linker moves Mamba states of HybridReqToTokenPool, not {kind}")
    side = {
        "int8 Mamba checkpoints": getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None,
        "short-conv states": getattr(getattr(req_to_token_pool, "short_conv_pool", None), "enabled", False),
        "n-gram states": getattr(getattr(req_to_token_pool, "ngram_pool", None), "enabled", False),
    }
    if any(side.values()):
        raise UnsupportedKVLayout(f"kvferry's SGLang linker does not move {', '.join(k for k, v in side.items() if v)}")
    layers = sorted(req_to_token_pool.mamba_map, key=req_to_token_pool.mamba_map.get)
    cache = req_to_token_pool.mamba_pool.mamba_cache
    tensors = {"temporal": cache.temporal, **{f"conv{i}": conv for i, conv in enumerate(cache.conv)}}
    objects = []
    for name, tensor in tensors.items():
        if tensor.numel() == 0:  # a conv-only model's temporal state
            continue
        views = [_slot_bytes(tensor[i], f"{name} of layer {layer}") for i, layer in enumerate(layers)]
        kv = state_kv(views, [f"layer.{layer}.{name}" for layer in layers], views[0].stride(0), page_size)
        objects.append(PoolObjects(kv, f"{MAMBA}.{name}", tuple(i - start_layer for i in layers), state=True))
    return tuple(objects)


def _slot_bytes(layer: torch.Tensor, what: str) -> torch.Tensor:
    """One layer's states ``[slots, ...]`` as ``[slots, 1, 1, state bytes]`` uint8 (vLLM's state view, which
    `state_kv` takes); UnsupportedKVLayout where a slot's state is not one dense run of bytes."""
    slot = layer[0]
    span = sum((size - 1) * stride for size, stride in zip(slot.shape, slot.stride(), strict=True)) + 1
    if slot.numel() == 0 or span != slot.numel() or min(slot.stride(), default=1) < 1:
        raise UnsupportedKVLayout(f"the Mamba {what} is {tuple(layer.shape)} with strides {layer.stride()}")
    size = layer.element_size()
    state_bytes, slot_stride = slot.numel() * size, layer.stride(0) * size
    rows = torch.empty(0, dtype=torch.uint8, device=layer.device)
    rows.set_(layer.untyped_storage(), layer.storage_offset() * size, (layer.shape[0], 1, 1, state_bytes),
              (slot_stride, state_bytes, state_bytes, 1))  # fmt: skip
    return rows
