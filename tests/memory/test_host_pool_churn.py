"""A million random alloc/free operations: accounting stays exact and fragmentation stays bounded."""

from __future__ import annotations

import random

import torch

from kvferry.memory import HostPool

MIB = 1024 * 1024
OPS = 1_000_000
ALIGNMENT = 4096
DTYPES = (torch.uint8, torch.bfloat16, torch.float32)


def random_request(rng: random.Random) -> tuple[tuple[int, int], torch.dtype]:
    """Mostly small objects, some chunk-sized ones and a few large ones, in several dtypes."""
    dtype = DTYPES[int(rng.random() * len(DTYPES))]
    roll = rng.random()
    limit = 16 * 1024 if roll < 0.7 else 512 * 1024 if roll < 0.97 else 4 * MIB
    rows = 1 + int(rng.random() * 16)
    return (rows, 1 + int(rng.random() * limit) // (rows * dtype.itemsize)), dtype


def check_free_list_against_live(pool: HostPool, live: list[tuple[torch.Tensor, int]]) -> None:
    """Derive the free gaps from the live allocations and compare them with the pool's view."""
    gaps = []
    cursor = 0
    for offset, reserved in sorted((pool.offset_of(t), pool.allocation(t).reserved_bytes) for t, _ in live):
        assert offset >= cursor, "two live allocations overlap"
        if offset > cursor:
            gaps.append(offset - cursor)
        cursor = offset + reserved
    if cursor < pool.capacity_bytes:
        gaps.append(pool.capacity_bytes - cursor)
    assert pool.free_bytes == sum(gaps)
    assert pool.num_free_extents == len(gaps)
    assert pool.largest_free_bytes == max(gaps, default=0)


def test_million_random_ops() -> None:
    rng = random.Random(20240601)
    pool = HostPool(64 * MIB, alignment=ALIGNMENT)
    live: list[tuple[torch.Tensor, int]] = []  # (tensor, the bytes the model expects it to reserve)
    reserved = 0  # the model's count of reserved bytes
    failures = 0
    max_extents = 0
    for step in range(OPS):
        # Allocating slightly more often than freeing keeps the pool near full, where fragmentation bites.
        if live and rng.random() < 0.47:
            index = int(rng.random() * len(live))
            live[index], live[-1] = live[-1], live[index]
            tensor, size = live.pop()
            reserved -= size
            pool.free(tensor)
        else:
            shape, dtype = random_request(rng)
            tensor = pool.try_alloc(shape, dtype)
            if tensor is None:
                failures += 1
            else:
                size = -(-shape[0] * shape[1] * dtype.itemsize // ALIGNMENT) * ALIGNMENT
                live.append((tensor, size))
                reserved += size
        assert pool.used_bytes == reserved, f"accounting drifted at step {step}"
        extents = pool.num_free_extents
        assert extents <= len(live) + 1, f"{extents} free extents for {len(live)} allocations at step {step}"
        if extents > max_extents:
            max_extents = extents
        if step % 100_000 == 0:
            check_free_list_against_live(pool, live)
    check_free_list_against_live(pool, live)
    assert failures > 1000, "the churn should run the pool full often"
    assert max_extents > 10, "the churn should fragment the pool"
    for tensor, _ in live:
        pool.free(tensor)
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    assert pool.largest_free_bytes == pool.capacity_bytes
    assert pool.num_free_extents == 1
