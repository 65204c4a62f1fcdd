"""The shape of a store/retrieve request: argument checks and block-id selection, independent of the cache.

Every request is checked whole before the cache touches its index or its pool: a request refused for bad
arguments must not evict, reserve or count anything, whether or not it would have copied a byte (a store of a
prompt that is cached already, a retrieve that misses). Its block ids are checked once, by
`kvferry.transfer.block_ids.check_block_ids`, and the transfer takes what that returns as checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvferry.formats import EngineKVFormat, layout_of
from kvferry.transfer.block_ids import CheckedBlockIds


def layout_name(fmt: EngineKVFormat | int, shape: Sequence[int]) -> str:
    """The object layout in cache keys: the object's kind and shape, not the engine's format, so an engine of any
    layout whose objects hold the same bytes (vLLM's six GPU orders, the CPU backend's ISAs) shares them."""
    return f"{layout_of(fmt).object_kind}:{'x'.join(str(d) for d in shape)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_skip(skip_prefix_tokens: int, n_tokens: int) -> int:
    if isinstance(skip_prefix_tokens, bool) or not isinstance(skip_prefix_tokens, int) or skip_prefix_tokens < 0:
        raise ValueError(f"skip_prefix_tokens={skip_prefix_tokens!r} must be an int >= 0")
    if skip_prefix_tokens > n_tokens:
        raise ValueError(f"skip_prefix_tokens={skip_prefix_tokens} exceeds len(tokens)={n_tokens}")
    return skip_prefix_tokens


def token_count(tokens: object) -> int:
    """``len(tokens)``, or a TypeError naming ``tokens`` (its values are checked when they are hashed)."""
    try:
        return len(tokens)  # type: ignore[arg-type]  # any object: len() itself tells whether it has one
    except TypeError:
        raise TypeError(
            f"tokens must be a sequence of token ids (a list, numpy array or 1-D tensor of ints), "
            f"got {type(tokens).__name__}"
        ) from None


def select_blocks(block_ids: CheckedBlockIds, chunks: list[int], per_chunk: int) -> CheckedBlockIds:
    """The block ids of ``chunks`` (ascending chunk indices), in order: one slice when they are consecutive."""
    if chunks[-1] - chunks[0] == len(chunks) - 1:
        return block_ids[chunks[0] * per_chunk : (chunks[-1] + 1) * per_chunk]
    firsts = np.asarray(chunks, dtype=np.int64) * per_chunk
    return block_ids.take((firsts[:, None] + np.arange(per_chunk, dtype=np.int64)).ravel())
