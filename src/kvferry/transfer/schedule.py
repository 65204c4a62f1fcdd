"""How a staged GPU request is cut into slices and placed in the staging ring: pure arithmetic on its shape.

A request's objects (after the skipped ones) are cut into slices of about a target size: consecutive whole objects,
or row ranges of one object larger than the target (rows are contiguous in an object, so each range is one DMA).
Each slice gets the next slot of the ring; the kernel places whole objects at word offsets in their slot (the
offsets table) and a row range at the start of its slot (a shift). The result depends only on the shape, so the
engine caches it (`TransferEngine._staged`): a request then fills in only its block ids and object addresses, and
`dma_runs` joins the DMAs of objects that sit back to back in one allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

MiB = 1 << 20


class Ring(NamedTuple):
    """A lane's staging ring: where it is, its slots, and the slot the next request starts in."""

    staging_ptr: int
    slot_bytes: int
    slots: int
    next_slot: int


@dataclass(frozen=True)
class Step:
    """One slice, resolved: its slot, the kernel's token range / row range / staging shift, and its DMA parts
    (object index, byte offset in the object, bytes, staging address)."""

    slot: int
    row0: int
    n_rows: int
    rows: tuple[int, int] | None
    shift: int
    parts: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class Schedule:
    first: int  # first object not skipped entirely
    head_rows: int  # a store's partly skipped first object: its skipped token count (it goes zero-copy); else 0
    tables: bytes  # staging word offset and capacity of every object, then the head object's [0, cap] (int64s)
    steps: tuple[Step, ...]
    next_slot: int  # the ring's next slot after this request
    runs: bool  # some slice holds several objects (its DMA may run across adjacent ones)
    slots: tuple[int, ...]  # the slots this request uses
    lead: frozenset[int]  # the steps that use their slot first: a retrieve enqueues their DMAs before anything else


@dataclass(frozen=True)
class Slice:
    """Consecutive whole objects, or one object's rows `rows[0]..rows[1]-1` (plane * NL + layer)."""

    members: list[int]
    rows: tuple[int, int] | None = None


def schedule(
    caps: list[int],
    *,
    rows: int,
    to_objects: bool,
    chunk_size: int,
    skip: int,
    bs: int,
    bytes_per_token: int,
    word: int,
    ring: Ring,
    slice_bytes: int | None = None,
) -> Schedule:
    """The schedule of a staged request of objects holding `caps` tokens (`rows` rows each), skipping `skip`
    blocks; `slice_bytes` overrides the default slice target (see `default_target`)."""
    per_object = chunk_size // bs
    sizes = [c * bytes_per_token for c in caps]
    first = skip // per_object  # objects before this one are skipped entirely
    # A store must not overwrite the skipped head of a partly skipped object: that object goes zero-copy.
    head = to_objects and skip % per_object != 0
    target = slice_bytes or default_target(sum(sizes[first + head :]), ring.slot_bytes)
    slices = cut_slices(sizes, first + head, rows, ring.slot_bytes, target)
    offsets = [0] * len(caps)  # word offsets in staging of whole-object slices (split ones use a shift)
    steps = []
    for n, sl in enumerate(slices):
        slot = (ring.next_slot + n) % ring.slots
        dev = ring.staging_ptr + slot * ring.slot_bytes
        o0 = sl.members[0]
        row0 = max(o0 * chunk_size, skip * bs)
        n_rows = o0 * chunk_size + sum(caps[o] for o in sl.members) - row0
        if sl.rows is None:
            parts = []
            for o in sl.members:
                offsets[o] = (dev - ring.staging_ptr) // word
                parts.append((o, 0, sizes[o], dev))
                dev += sizes[o]
            steps.append(Step(slot, row0, n_rows, None, 0, tuple(parts)))
        else:  # rows r0..r1 of one object, placed at the start of the slot
            row_bytes = sizes[o0] // rows
            shift = (slot * ring.slot_bytes - sl.rows[0] * row_bytes) // word
            part = (o0, sl.rows[0] * row_bytes, (sl.rows[1] - sl.rows[0]) * row_bytes, dev)
            steps.append(Step(slot, row0, n_rows, sl.rows, shift, (part,)))
    tables = np.asarray([*offsets, *caps, 0, caps[first] if first < len(caps) else 0], dtype=np.int64).tobytes()
    return Schedule(
        first=first,
        head_rows=skip % per_object * bs if head else 0,
        tables=tables,
        steps=tuple(steps),
        next_slot=(ring.next_slot + len(slices)) % ring.slots,
        runs=any(len(step.parts) > 1 for step in steps),
        slots=tuple(sorted({step.slot for step in steps})),
        lead=frozenset({step.slot: i for i, step in reversed(list(enumerate(steps)))}.values()),
    )


def default_target(total: int, slot_bytes: int) -> int:
    """About a quarter of the request per slice, so even a one-chunk request overlaps its gather with its DMA; at
    most half a slot; at least 8 MiB. Each slice costs a launch, a DMA set-up and two cross-stream waits, while only
    a store's first gather (a retrieve's last scatter) is on the critical path: ~7 us for 8 MiB. One llama chunk in
    8 MiB slices beat 16 MiB ones by ~0.01 in 7 of 8 paired comparisons on the H200.
    (A still smaller first slice measured slower: its extra launch costs more CPU than its gather saves.)"""
    return min(slot_bytes // 2, max(8 * MiB, total // 4))


def lead_objects(n_objects: int, object_bytes: int, slot_bytes: int, slice_bytes: int | None) -> int:
    """How many whole objects the first slice of a retrieve of `n_objects` objects of `object_bytes` joins, as
    `cut_slices` cuts it (1 where an object is cut into row ranges)."""
    target = slice_bytes or default_target(n_objects * object_bytes, slot_bytes)
    return 1 if object_bytes > target else max(1, min(n_objects, target // object_bytes))


def lead_bytes(
    n_objects: int, object_bytes: int, rows: int, slot_bytes: int, slice_bytes: int | None, run: int = 1
) -> int | None:
    """The first DMA of a retrieve of `n_objects` whole objects of `object_bytes` (`rows` rows each, none skipped),
    as `cut_slices` cuts it: its first row range where an object is larger than a slice, else as many of the first
    slice's objects as lie back to back from the first (`run` of them do; the slice's other objects' DMAs follow it
    on the slot's stream); None where a row does not fit a slot."""
    target = slice_bytes or default_target(n_objects * object_bytes, slot_bytes)
    if object_bytes > target:
        row_bytes = object_bytes // rows
        return None if row_bytes > slot_bytes else min(rows, max(1, target // row_bytes)) * row_bytes
    return min(run, lead_objects(n_objects, object_bytes, slot_bytes, slice_bytes)) * object_bytes


def cut_slices(sizes: list[int], first: int, rows: int, slot_bytes: int, target: int) -> list[Slice]:
    """Cut objects `first..` (of `sizes` bytes, `rows` rows each) into slices of about `target` bytes: consecutive
    whole objects, or row ranges of one object larger than the target."""
    slices: list[Slice] = []
    size = 0
    for o in range(first, len(sizes)):
        if sizes[o] > target:  # cut into row ranges; nothing joins them
            row_bytes = sizes[o] // rows
            if row_bytes > slot_bytes:
                raise ValueError(
                    f"one object row of {row_bytes} bytes does not fit a {slot_bytes}-byte staging slot: "
                    "raise EngineConfig.slot_bytes or lower the chunk size"
                )
            step = max(1, target // row_bytes)
            slices += [Slice([o], (r, min(r + step, rows))) for r in range(0, rows, step)]
            size = target
        elif slices and slices[-1].rows is None and size + sizes[o] <= target:
            slices[-1].members.append(o)
            size += sizes[o]
        else:
            slices.append(Slice([o]))
            size = sizes[o]
    return slices


def dma_runs(
    objects: list[torch.Tensor] | torch.Tensor,
    parts: tuple[tuple[int, int, int, int], ...],
    ptrs: list[int],
    one_slab: bool,
) -> list[tuple[int, int, int]]:
    """A slice's DMAs (``parts``: a `Step`'s, or those after a lead DMA took its first): (host address, staging
    address, bytes), one per run of objects adjacent in host memory.

    A run may only extend across objects of one pinned allocation: `one_slab` says they are one (a registered
    pinned slab, the pool's, holds them all, or they came as one tensor: `Checked.one_allocation`); otherwise
    each pair is compared by storage. This part depends on the objects' addresses, so it runs per request, not
    in the cached schedule."""
    last, offset, n, dev = parts[0]
    host = ptrs[last] + offset
    runs = []
    for o, _, size, _ in parts[1:]:
        if host + n == ptrs[o] and (one_slab or _same_storage(objects[last], objects[o])):
            n += size  # the same pinned allocation continues: extend the run
        else:
            runs.append((host, dev, n))
            host, dev, n = ptrs[o], dev + n, size
        last = o
    runs.append((host, dev, n))
    return runs


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
