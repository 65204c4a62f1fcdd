"""Block ids: the type a request's block ids come as (`BlockIds`), their one check (`check_block_ids`), and what
the check returns (`CheckedBlockIds`), which every layer below takes without looking at the ids again.

A request's ids are checked once in each process, where the request enters kvferry there: a cache engine's store
or retrieve (which knows how many blocks its chunks need), or a direct ``kvferry.transfer(...)`` call. The check
packs them once into a private int64 array (a caller changing its list afterwards changes nothing that moves) and
records what it found true of them: every id from ``checked_from`` on lies in a pool of ``num_blocks`` blocks, and
with ``distinct`` (a retrieve writes each of its blocks) none of those repeats. The transfer takes a
`CheckedBlockIds` that covers its request as it is: a second check of a long request's ids is host time on the path
to its first GPU operation. Its passes are C-level (array packing, min/max, a set or a sort), never a Python loop
per block.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, NoReturn, TypeVar

import numpy as np
import torch


class CheckedBlockIds:
    """Block ids that passed `check_block_ids`: ``ids`` (1-D int64, private to kvferry: never written) and what was
    checked of them. Sliced (``[a:b]``) or taken (`take`), what was checked stays known."""

    __slots__ = ("checked_from", "distinct", "ids", "num_blocks")

    def __init__(self, ids: np.ndarray, num_blocks: int, checked_from: int, distinct: bool) -> None:
        self.ids = ids
        self.num_blocks = num_blocks  # ids[checked_from:] are within 0 .. num_blocks - 1
        self.checked_from = checked_from  # the ids before are not copied: the engine's own business
        self.distinct = distinct  # no id of ids[checked_from:] repeats

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, part: slice) -> CheckedBlockIds:
        start, stop, step = part.indices(len(self.ids))
        if step != 1:
            raise ValueError("CheckedBlockIds slices are contiguous (step 1)")
        return CheckedBlockIds(self.ids[start:stop], self.num_blocks, max(self.checked_from - start, 0), self.distinct)

    def take(self, positions: np.ndarray) -> CheckedBlockIds:
        """The ids at ``positions`` (ascending, none twice), in that order."""
        before = int(np.searchsorted(positions, self.checked_from))  # positions whose ids were not checked
        return CheckedBlockIds(self.ids[positions], self.num_blocks, before, self.distinct)

    def covers(self, num_blocks: int, start: int, distinct: bool) -> bool:
        """Whether ``ids[start:]`` passed the checks of a request on a pool of ``num_blocks`` blocks (``distinct``:
        one that writes its blocks)."""
        return (
            self.num_blocks <= num_blocks
            and self.checked_from <= start
            and (self.distinct or not distinct or len(self.ids) - start <= 1)
        )

    def __repr__(self) -> str:
        return (
            f"CheckedBlockIds({self.ids.tolist()}, num_blocks={self.num_blocks}, checked_from={self.checked_from}, "
            f"distinct={self.distinct})"
        )


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PendingBlockIds(Generic[T]):
    """A request's ``count`` block ids whose check the transfer runs itself, once the request's first copies into
    staging are in flight: a GPU retrieve's first DMA (which touches no KV) then waits for no check, ~0.1-0.2 ms of
    host time on a 16-chunk load. ``check()`` returns the checked ids or raises as `check_block_ids` does; the
    transfer then writes no block. Taken only where a GPU transfer moves pool objects (`transfer_pool_async`)."""

    count: int
    check: Callable[[], T]

    def __len__(self) -> int:
        return self.count


BlockIds = Sequence[int] | np.ndarray | torch.Tensor | CheckedBlockIds
"""A request's block ids: entry ``i`` is the engine block of tokens ``i*BS .. i*BS+BS-1``. A list, tuple, numpy
array or 1-D tensor of ints, or ids checked already (`CheckedBlockIds`)."""

# Below this many ids, the range and repeat checks run on a Python list (a numpy reduction costs ~1.5 us however
# small its array).
_SMALL_IDS = 128


def check_block_ids(
    block_ids: BlockIds,
    num_blocks: int,
    block_size: int,
    *,
    needed: int,
    start: int = 0,
    distinct: bool,
    objects: int | None = None,
) -> CheckedBlockIds:
    """Check the block ids a request copies with, ``block_ids[start:needed]``: integers, 1-D, within a pool of
    ``num_blocks`` blocks, and with ``distinct`` (a retrieve writes them) no block twice. The first ``start`` ids
    are not copied and not range-checked; ids after the first ``needed`` are not used. ``objects``: the ids are
    those of that many chunk objects' blocks, exactly ``needed`` of them; else at least ``needed`` ids (one per
    ``block_size`` tokens of the request's full chunks, from token 0). Raises ValueError/TypeError naming
    ``block_ids``; returns the first ``needed`` ids, checked. A `CheckedBlockIds` is checked again from its ids."""
    if type(block_ids) is CheckedBlockIds:
        block_ids = block_ids.ids
    if isinstance(block_ids, np.ndarray | torch.Tensor) and block_ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    try:
        given = len(block_ids)  # whatever was passed: len() itself tells
    except TypeError:
        raise TypeError(
            f"block_ids must be a sequence of ints, a numpy array or a 1-D tensor of them, "
            f"got {type(block_ids).__name__}"
        ) from None
    if given < needed or (objects is not None and given != needed):
        if objects is not None:
            why = f"the {objects} objects hold {needed} blocks ({needed * block_size} tokens / block size {block_size})"
        else:
            why = f"the full chunks of tokens need {needed} (one per {block_size} tokens, from token 0)"
        raise ValueError(f"block_ids has {given} entries but {why}")
    if type(block_ids) is list and needed < _SMALL_IDS:
        head = block_ids[:needed] if given > needed else block_ids
        if _all_ints(head):
            _check_values(head[start:], start, num_blocks, distinct)  # before packing: a huge int is outside
            return CheckedBlockIds(np.array(head, dtype=np.int64), num_blocks, start, distinct)
    ids = _packed(block_ids, needed)  # type: ignore[arg-type]  # a CheckedBlockIds was unwrapped above
    if start < needed:
        copied = ids[start:] if start else ids
        if len(copied) < _SMALL_IDS:
            _check_values(copied.tolist(), start, num_blocks, distinct)
        elif distinct:  # sorted once: the ends give the range, neighbours the repeats
            ordered = np.sort(copied)
            if ordered[0] < 0 or ordered[-1] >= num_blocks:
                _outside(copied, start, num_blocks)
            if (ordered[1:] == ordered[:-1]).any():
                _repeated()
        elif int(copied.view(np.uint64).max()) >= num_blocks:  # one pass: a negative id is a huge unsigned one
            _outside(copied, start, num_blocks)
    return CheckedBlockIds(ids, num_blocks, start, distinct)


def _check_values(ids: list[int], start: int, num_blocks: int, distinct: bool) -> None:
    """The range and repeat checks on a few ids as a Python list (its min, max and set beat numpy's per-call
    cost); ``ids`` are those from ``start`` on."""
    if not ids:
        return
    if min(ids) < 0 or max(ids) >= num_blocks:
        _outside(ids, start, num_blocks)
    if distinct and len(set(ids)) != len(ids):
        _repeated()


def _outside(ids: list[int] | np.ndarray, start: int, num_blocks: int) -> NoReturn:
    """Raise the error naming the first id outside the pool (``ids`` are those from ``start`` on)."""
    if isinstance(ids, list):  # a few ids
        bad = next(i for i, b in enumerate(ids) if not 0 <= b < num_blocks)
    else:
        bad = int(np.flatnonzero((ids < 0) | (ids >= num_blocks))[0])
    raise ValueError(f"block_ids[{start + bad}]={int(ids[bad])} is outside the pool of {num_blocks} blocks")


def _repeated() -> NoReturn:
    raise ValueError("block_ids repeats a block: a retrieve would write one block from two places")


def _packed(block_ids: Sequence[int] | np.ndarray | torch.Tensor, needed: int) -> np.ndarray:
    """The first ``needed`` of ``block_ids`` (1-D, at least that many) as a private int64 array (none: nothing to
    check of their kind)."""
    if isinstance(block_ids, torch.Tensor):
        dtype = block_ids.dtype
        if needed and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            raise TypeError(f"block_ids must hold integers, got dtype {dtype}")
        rows = block_ids.detach()[:needed]
        if dtype is not torch.int64 or not rows.is_cpu:
            return rows.to(device="cpu", dtype=torch.int64).numpy()  # a new tensor: private already
        return rows.numpy().copy()
    if isinstance(block_ids, np.ndarray):
        if needed and block_ids.dtype.kind not in "iu":  # a float would be truncated, a digit string parsed
            raise TypeError(f"block_ids must hold integers, got {block_ids.dtype} values")
        return block_ids[:needed].astype(np.int64)  # a copy, whatever the dtype
    head = block_ids[:needed] if len(block_ids) > needed else block_ids
    try:  # array's packing is C-level: a list of Python ints packs ~4x faster than numpy converts it
        return np.frombuffer(array.array("q", head), dtype=np.int64)
    except (TypeError, OverflowError):
        pass  # numpy's view of them says what they are
    try:
        values = np.asarray(head)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"block_ids must be a sequence of ints: {exc}") from None
    if values.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {values.shape}")
    if values.dtype.kind not in "iu":  # a float would be truncated, a digit string parsed
        raise TypeError(f"block_ids must be a sequence of ints, got {values.dtype} values")
    return values.astype(np.int64)  # ints beyond int64 (uint64's): wrapped, and refused as outside the pool


def _all_ints(ids: list[object]) -> bool:
    """Whether a list holds Python ints only, in one C-level pass: any float makes the sum a float."""
    try:
        return type(sum(ids)) is int  # type: ignore[arg-type]  # a non-number's TypeError is an answer too
    except TypeError:
        return False
