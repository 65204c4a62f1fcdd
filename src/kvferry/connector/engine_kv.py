"""The engine's KV cache as the connector sees it, whichever engine hands it over (an adapter under
`kvferry.integrations` recognises the engine's tensors and builds an `EngineKV`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvferry.formats import EngineKVFormat


class UnsupportedKVLayout(ValueError):
    """The engine's KV cache is in a layout this connector does not move (the message says which and why)."""


@dataclass(frozen=True)
class EngineKV:
    """The engine's KV as kvferry sees it: the format, what kvferry's copies take (``paged``), vLLM's per-layer
    tensors in layer order, the tokens of one block of those tensors and the cache's element type (vLLM's
    ``cache_dtype`` where it quantises, else the tensors' dtype): fp8 caches of both encodings are uint8 tensors,
    so the encoding must name the cache key space.

    ``split``: the tensors' blocks per scheduler block (vLLM splits each block into kernel blocks when its
    attention kernel takes smaller ones); `kernel_block_ids` turns the scheduler's block ids into theirs."""

    fmt: EngineKVFormat
    paged: list[torch.Tensor] | list[list[torch.Tensor]] | torch.Tensor  # nested as `fmt` nests its tensors
    layers: list[torch.Tensor]
    layer_names: list[str]
    block_size: int
    kv_dtype: str
    heads: tuple[int, int] | None = None  # (first head, the model's heads) on a tensor-parallel rank; else None
    order: str = "LBHNC"  # vLLM's physical order of the tensors' axes (KVCacheLayout's name)
    split: int = 1

    def kernel_block_ids(self, block_ids: list[int]) -> list[int] | np.ndarray:
        """The tensors' block ids for the scheduler's ``block_ids`` (the same list when blocks are not split)."""
        if self.split == 1:
            return block_ids
        ids = np.asarray(block_ids, dtype=np.int64)
        return (ids[:, None] * self.split + np.arange(self.split, dtype=np.int64)).ravel()
