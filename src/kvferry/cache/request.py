"""The shape of a store/retrieve request: argument checks and block-id selection, independent of the cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvferry.formats import EngineKVFormat

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def layout_name(fmt: EngineKVFormat | int, shape: Sequence[int]) -> str:
    return f"{EngineKVFormat(fmt).name}:{'x'.join(str(d) for d in shape)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_skip(skip_prefix_tokens: int, n_tokens: int) -> int:
    if isinstance(skip_prefix_tokens, bool) or not isinstance(skip_prefix_tokens, int) or skip_prefix_tokens < 0:
        raise ValueError(f"skip_prefix_tokens={skip_prefix_tokens!r} must be an int >= 0")
    if skip_prefix_tokens > n_tokens:
        raise ValueError(f"skip_prefix_tokens={skip_prefix_tokens} exceeds len(tokens)={n_tokens}")
    return skip_prefix_tokens


def check_block_ids(block_ids: BlockIds, needed: int, block_size: int) -> None:
    if len(block_ids) < needed:
        raise ValueError(
            f"block_ids has {len(block_ids)} entries but the full chunks of tokens need {needed} "
            f"(one per {block_size} tokens, from token 0)"
        )


def select_blocks(block_ids: BlockIds, chunks: list[int], per_chunk: int) -> BlockIds:
    """The block ids of ``chunks`` (ascending chunk indices), in order: one slice when they are consecutive."""
    if chunks[-1] - chunks[0] == len(chunks) - 1:
        return block_ids[chunks[0] * per_chunk : (chunks[-1] + 1) * per_chunk]
    rows = [range(c * per_chunk, (c + 1) * per_chunk) for c in chunks]
    if isinstance(block_ids, torch.Tensor | np.ndarray):
        index = np.fromiter((i for r in rows for i in r), dtype=np.int64)
        return block_ids[torch.from_numpy(index) if isinstance(block_ids, torch.Tensor) else index]
    return [block_ids[i] for r in rows for i in r]
