"""The shape of a store/retrieve request: argument checks and block-id selection, independent of the cache.

Every request is checked whole before the cache touches its index or its pool: a request refused for bad
arguments must not evict, reserve or count anything, whether or not it would have copied a byte (a store of a
prompt that is cached already, a retrieve that misses). The checks are C-level passes over the ids (array
packing, min/max, a set), never a Python loop per block.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import torch

from kvferry.formats import EngineKVFormat, layout_of

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


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


# Below this many ids the range and repeat checks run on a Python list (C-level builtins); above, numpy's.
_SMALL_IDS = 128


def check_block_ids(
    block_ids: BlockIds, start: int, needed: int, num_blocks: int, block_size: int, *, distinct: bool
) -> BlockIds:
    """Check the block ids a request's full chunks map to, ``block_ids[start:needed]`` (the blocks from the first
    one a copy could touch to the end of the last full chunk): integers, within the engine's ``num_blocks``, and
    with ``distinct`` (a retrieve writes them) no block twice. Raises ValueError/TypeError naming ``block_ids``.

    Returns the ids to copy with: ``block_ids`` itself, or for a long list its first ``needed`` ids as an int64
    array (packed once here; the transfer would otherwise convert the list again)."""
    try:
        given = len(block_ids)
    except TypeError:
        raise TypeError(
            f"block_ids must be a sequence of ints, a numpy array or a 1-D tensor of them, "
            f"got {type(block_ids).__name__}"
        ) from None
    if given < needed:
        raise ValueError(
            f"block_ids has {given} entries but the full chunks of tokens need {needed} "
            f"(one per {block_size} tokens, from token 0)"
        )
    if start >= needed:
        return block_ids
    if type(block_ids) is list and needed >= _SMALL_IDS:
        try:
            block_ids = np.frombuffer(array.array("q", block_ids[:needed]), dtype=np.int64)
        except (TypeError, OverflowError) as exc:
            raise TypeError(f"block_ids must be a sequence of ints: {exc}") from None
        given = needed
    ids = block_ids if start == 0 and needed == given else block_ids[start:needed]
    if type(ids) is not list or len(ids) >= _SMALL_IDS or not _all_ints(ids):
        ids = _id_values(ids)
    if isinstance(ids, list):
        lo, hi = min(ids), max(ids)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        bad = next(i for i, b in enumerate(ids) if not 0 <= b < num_blocks)  # only on the error path
        raise ValueError(f"block_ids[{start + bad}]={int(ids[bad])} is outside the pool of {num_blocks} blocks")
    if distinct and len(ids) > 1 and _repeats(ids):
        raise ValueError("block_ids repeats a block: a retrieve would write one block from two places")
    return block_ids


def _all_ints(ids: list[object]) -> bool:
    """Whether a list holds Python ints only, in one C-level pass: any float makes the sum a float."""
    try:
        return type(sum(ids)) is int  # type: ignore[arg-type]  # a non-number's TypeError is an answer too
    except TypeError:
        return False


def _id_values(ids: BlockIds) -> list[int] | np.ndarray:
    """``ids`` (not a short list of Python ints) as a list of ints when short, else a 1-D integer numpy array."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"block_ids must hold integers, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {tuple(ids.shape)}")
        ids = ids.detach().cpu().numpy()
    if not isinstance(ids, np.ndarray):
        try:
            ids = np.frombuffer(array.array("q", ids), dtype=np.int64)
        except (TypeError, OverflowError) as exc:
            raise TypeError(f"block_ids must be a sequence of ints: {exc}") from None
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":  # a float would be truncated, a digit string parsed
        raise TypeError(f"block_ids must hold integers, got {ids.dtype} values")
    return ids.tolist() if len(ids) < _SMALL_IDS else ids  # small: builtins beat numpy's per-call cost


def _repeats(ids: list[int] | np.ndarray) -> bool:
    if isinstance(ids, list):
        return len(set(ids)) != len(ids)
    ordered = np.sort(ids)  # a repeat sits next to itself once sorted
    return bool((ordered[1:] == ordered[:-1]).any())


def select_blocks(block_ids: BlockIds, chunks: list[int], per_chunk: int) -> BlockIds:
    """The block ids of ``chunks`` (ascending chunk indices), in order: one slice when they are consecutive."""
    if chunks[-1] - chunks[0] == len(chunks) - 1:
        return block_ids[chunks[0] * per_chunk : (chunks[-1] + 1) * per_chunk]
    rows = [range(c * per_chunk, (c + 1) * per_chunk) for c in chunks]
    if isinstance(block_ids, torch.Tensor | np.ndarray):
        index = np.fromiter((i for r in rows for i in r), dtype=np.int64)
        return block_ids[torch.from_numpy(index) if isinstance(block_ids, torch.Tensor) else index]
    return [block_ids[i] for r in rows for i in r]
