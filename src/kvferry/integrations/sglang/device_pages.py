"""SGLang's device KV pool (the one the forward pass reads) as kvferry's copies see it, without importing SGLang.

The unified-cache linker moves pages straight between this pool and kvferry's cache, with no host tier between.
SGLang's token-major ("nhd") pools are one tensor per layer whose rows are token slots, a page being ``page_size``
consecutive slots (slot 0's page is padding that absorbs dummy writes; requests never own it):

=====  ============================================  ===========================  =======================
pool   per layer                                     kvferry format               object (page) shape
=====  ============================================  ===========================  =======================
MHA    K and V: ``[slots, kv heads, head dim]``      ``TWO_X_NL_X_NBBS_NH_HS``    ``[2, layers, page, H*D]``
MLA    ``[slots, 1, kv_lora_rank + rope dim]``       ``NL_X_NBBS_ONE_HS``         ``[1, layers, page, W]``
=====  ============================================  ===========================  =======================

kvferry's block is SGLang's page, so a block id is a slot // page_size. The objects have the shape and kind of
those the HiCache backend stores from SGLang's host pool (`host_pages`), and cache keys name the object's kind and
shape, not the engine's format: a page either of them stored is the other's too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvferry.cache.request import dtype_name
from kvferry.connector.engine_kv import EngineKV, UnsupportedKVLayout
from kvferry.formats import EngineKVFormat

# The device pools whose buffers are exactly the per-layer tensors above; their subclasses keep more (fp4 / mxfp8
# scales, a DSA indexer, page-major rows), which a page copy of these tensors alone would lose.
POOLS = ("MHATokenToKVPool", "MLATokenToKVPool")


def device_kv(pool: Any, layer_ids: Sequence[int] = ()) -> EngineKV:
    """kvferry's view of SGLang's device pool ``pool`` (no copy): its pages as blocks, its layers named by the
    model's ``layer_ids`` (default: the pool's own, from its first layer). UnsupportedKVLayout naming what is not
    moved (another pool class, a layout other than ``nhd``, a quantised cache with scales, K and V of different
    widths)."""
    kind = type(pool).__name__
    if kind not in POOLS:
        raise UnsupportedKVLayout(
            f"kvferry's SGLang linker moves the device pools {', '.join(POOLS)}, not {kind}: hybrid models' pools, "
            "quantised (fp4, mxfp8) and sparse-attention pools are not supported yet"
        )
    page_size = int(pool.page_size)
    if kind == "MHATokenToKVPool":
        layout = getattr(pool, "kv_cache_layout", None)
        if layout != "nhd":
            raise UnsupportedKVLayout(
                f"kvferry's SGLang linker moves the token-major ('nhd') MHA pool; this one is {layout!r} "
                "(SGLANG_USE_HND_KVCACHE or the attention backend's layout)"
            )
        if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "v_scale_buffer", None) is not None:
            raise UnsupportedKVLayout("kvferry's SGLang linker does not move a KV cache quantised with scales")
        if pool.head_dim != pool.v_head_dim:
            raise UnsupportedKVLayout(f"K ({pool.head_dim}) and V ({pool.v_head_dim}) of different widths")
        keys = [_whole_pages(t, page_size, (pool.head_num, pool.head_dim)) for t in pool.k_buffer]
        values = [_whole_pages(t, page_size, (pool.head_num, pool.v_head_dim)) for t in pool.v_buffer]
        fmt = EngineKVFormat.TWO_X_NL_X_NBBS_NH_HS
        paged: list[torch.Tensor] | list[list[torch.Tensor]] = [keys, values]
        layers = keys
    else:
        layers = [_whole_pages(t, page_size, (1, int(t.shape[-1]))) for t in pool.kv_buffer]
        fmt, paged = EngineKVFormat.NL_X_NBBS_ONE_HS, layers
    if not layers:
        raise UnsupportedKVLayout(f"SGLang's {kind} holds no layers")
    names = [f"layer.{layer}" for layer in layer_ids or range(pool.start_layer, pool.start_layer + len(layers))]
    return EngineKV(fmt, paged, layers, names, page_size, dtype_name(layers[0].dtype))


def _whole_pages(buffer: Any, page_size: int, row: tuple[int, ...]) -> torch.Tensor:
    """One layer's buffer cut to whole pages of slots (a last partial page is never allocated)."""
    if not isinstance(buffer, torch.Tensor) or tuple(buffer.shape[1:]) != row or buffer.stride(-1) != 1:
        shape = tuple(buffer.shape) if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise UnsupportedKVLayout(f"an SGLang KV buffer of shape {shape} is not [slots, {row[0]}, {row[1]}] rows")
    return buffer.narrow(0, 0, buffer.shape[0] // page_size * page_size)


def slot_pages(device_indices: torch.Tensor, num_pages: int, page_size: int) -> list[int]:
    """The pages of ``device_indices`` (SGLang's token slots: ``num_pages`` whole pages, one after another); a
    ValueError where they are not whole pages in order (SGLang's paged allocator hands out only such)."""
    slots = device_indices.to("cpu", torch.int64).reshape(-1)
    if slots.numel() != num_pages * page_size:
        raise ValueError(f"{slots.numel()} device slots for {num_pages} pages of {page_size} tokens")
    by_page = slots.reshape(num_pages, page_size)
    first = by_page[:, :1]
    in_order = torch.equal(by_page - first, torch.arange(page_size).expand_as(by_page))
    if not in_order or bool((first % page_size != 0).any()):
        raise ValueError(f"device slots that are not whole pages of {page_size} tokens: {slots.tolist()[:64]}")
    return (first.flatten() // page_size).tolist()
