"""SGLang's host KV pool (its HiCache tier in host memory) as kvferry's copies see it, without importing SGLang.

SGLang keeps one buffer for the pool, in one of its layouts (``--hicache-mem-layout``); kvferry views it with an
explicit page axis (`HostPages.pages`, no copy) and, from that, as kvferry's per-layer paged tensors:

==================  ====================================  =======================  ===========================
layout              MHA buffer (K and V)                  MLA buffer               page axis of `pages`
==================  ====================================  =======================  ===========================
layer_first         [2, layers, tokens, heads, head]      [layers, tokens, 1, W]   after the layers
page_first          [2, tokens, layers, heads, head]      [tokens, layers, 1, W]   first (after K/V)
page_first_direct   [2, pages, layers, page, heads, head] [pages, layers, page, 1, W]  first (after K/V)
==================  ====================================  =======================  ===========================

MHA layers are ``TWO_X_NL_X_NB_BS_NH_HS`` (K and V each a list of layers), MLA's ``NL_X_NB_BS_HS``: strided views
of the pool's buffer, so a page of any of these layouts holds one kvferry chunk object of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvferry.cache.request import dtype_name
from kvferry.connector.engine_kv import EngineKV, UnsupportedKVLayout
from kvferry.formats import EngineKVFormat

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# Per (MLA?, layout): which axis of the buffer holds tokens (split into pages of the page size, or None where the
# buffer already has a page axis), the page axis after the split, and the permutation of `pages` into the
# canonical order: MHA [2, layers, pages, page, heads, head], MLA [layers, pages, page, 1, W].
_AXES: dict[tuple[bool, str], tuple[int | None, int, tuple[int, ...]]] = {
    (False, "layer_first"): (2, 2, (0, 1, 2, 3, 4, 5)),
    (False, "page_first"): (1, 1, (0, 3, 1, 2, 4, 5)),
    (False, "page_first_direct"): (None, 1, (0, 2, 1, 3, 4, 5)),
    (True, "layer_first"): (1, 1, (0, 1, 2, 3, 4)),
    (True, "page_first"): (0, 0, (2, 0, 1, 3, 4)),
    (True, "page_first_direct"): (None, 0, (1, 0, 2, 3, 4)),
}


@dataclass(frozen=True)
class HostPages:
    """A host KV buffer with its page axis explicit: SGLang's pool, or a staging buffer of kvferry's in the same
    layout (`staging`)."""

    pages: torch.Tensor
    layout: str
    mla: bool
    page_size: int

    @property
    def page_axis(self) -> int:
        return _AXES[self.mla, self.layout][1]

    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[self.page_axis])

    def page(self, index: int) -> torch.Tensor:
        """Page ``index`` in the order of SGLang's flat data page (`get_data_page`) for this layout."""
        return self.pages.select(self.page_axis, index)

    def engine_kv(self) -> EngineKV:
        """kvferry's per-layer views of the buffer, its pages as blocks."""
        canonical = self.pages.permute(_AXES[self.mla, self.layout][2])
        paged: list[torch.Tensor] | list[list[torch.Tensor]]
        if self.mla:
            layers = [canonical[layer, :, :, 0] for layer in range(canonical.shape[0])]
            fmt, paged = EngineKVFormat.NL_X_NB_BS_HS, layers
        else:
            layers = [canonical[0, layer] for layer in range(canonical.shape[1])]
            fmt = EngineKVFormat.TWO_X_NL_X_NB_BS_NH_HS
            paged = [layers, [canonical[1, layer] for layer in range(canonical.shape[1])]]
        names = [f"layer.{i}" for i in range(len(layers))]
        return EngineKV(fmt, paged, layers, names, self.page_size, dtype_name(self.pages.dtype))

    def staging(self, num_pages: int) -> HostPages:
        """A buffer of ``num_pages`` pages in this layout (contiguous, kvferry's own)."""
        shape = list(self.pages.shape)
        shape[self.page_axis] = num_pages
        return HostPages(torch.empty(shape, dtype=self.pages.dtype), self.layout, self.mla, self.page_size)

    def copy_pages(self, pages: torch.Tensor, into: HostPages) -> None:
        """Pages ``pages`` of this buffer into the first ``len(pages)`` pages of ``into``."""
        target = into.pages.narrow(self.page_axis, 0, len(pages))
        if target.is_contiguous():  # gathered in place: no temporary, one pass over the bytes (4-8x faster)
            torch.index_select(self.pages, self.page_axis, pages, out=target)
        else:
            target.copy_(self.pages.index_select(self.page_axis, pages))

    def fill_pages(self, pages: torch.Tensor, source: HostPages) -> None:
        """Pages ``pages`` of this buffer from the first ``len(pages)`` pages of ``source``."""
        self.pages.index_copy_(self.page_axis, pages, source.pages.narrow(self.page_axis, 0, len(pages)))


def host_pages(pool: Any) -> HostPages:
    """SGLang's host pool ``pool`` (``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``); UnsupportedKVLayout
    naming what is not moved (other pools, layouts, K and V of different widths)."""
    kinds = {cls.__name__ for cls in type(pool).__mro__}
    mla = "MLATokenToKVPoolHost" in kinds
    if not mla and "MHATokenToKVPoolHost" not in kinds:
        raise UnsupportedKVLayout(f"kvferry's HiCache storage moves SGLang's MHA and MLA host pools, not {kinds}")
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        raise UnsupportedKVLayout(
            f"kvferry's HiCache storage moves the host pool layouts {', '.join(LAYOUTS)}; this pool is {layout!r} "
            "(--hicache-mem-layout)"
        )
    if not mla and pool.head_dim != pool.v_head_dim:
        raise UnsupportedKVLayout(f"K ({pool.head_dim}) and V ({pool.v_head_dim}) of different widths")
    buffer = pool.kv_buffer
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != (5 if mla else 6) - (layout != "page_first_direct"):
        raise UnsupportedKVLayout(f"SGLang's {layout} host buffer is not the one tensor kvferry reads")
    page_size = int(pool.page_size)
    token_axis = _AXES[mla, layout][0]
    if token_axis is not None:
        if buffer.shape[token_axis] % page_size:
            raise UnsupportedKVLayout(f"the host pool's {buffer.shape[token_axis]} tokens are not whole pages")
        buffer = buffer.unflatten(token_axis, (buffer.shape[token_axis] // page_size, page_size))
    return HostPages(buffer, layout, mla, page_size)
