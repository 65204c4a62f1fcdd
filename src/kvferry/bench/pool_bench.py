"""`kvferry bench pool`: host pool throughput, alloc+free operations per second, for the pool and its allocator alone.

Cases:
  chunk_pairs      alloc then free one llama3-8b chunk object ([2, 32, 256, 1024] bf16, 32 MiB) at a time
  random_churn     random alloc/free of mixed sizes and dtypes with a pool kept near full (fragmented)
  allocator_pairs  ExtentAllocator reserve+release alone, without tensor views (the pure-Python part)
Every case reports operations per second, counting an alloc and a free as one operation each.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, positive
from kvferry.bench.report import new_table
from kvferry.memory import HostPool
from kvferry.memory.extent_allocator import ExtentAllocator

MIB = 1024 * 1024
CHUNK_SHAPE = (2, 32, 256, 1024)
DTYPES = (torch.uint8, torch.bfloat16, torch.float32)

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench pool                                  # 200000 operations per case, a 1 GiB pool
  kvferry bench pool --ops 20000 --capacity-mib 256 --json bench-out/pool.json
"""


def chunk_pairs(pool: HostPool, ops: int) -> int:
    for _ in range(ops // 2):
        pool.free(pool.alloc(CHUNK_SHAPE, torch.bfloat16))
    return ops // 2 * 2


def random_churn(pool: HostPool, ops: int) -> int:
    rng = random.Random(0)
    requests = []
    for _ in range(1024):
        dtype = rng.choice(DTYPES)
        requests.append(((rng.randint(1, 16), rng.randint(1, 64 * 1024) // dtype.itemsize + 1), dtype))
    live: list[torch.Tensor] = []
    done = 0
    for step in range(ops):
        if live and rng.random() < 0.47:
            index = rng.randrange(len(live))
            live[index], live[-1] = live[-1], live[index]
            pool.free(live.pop())
            done += 1
        else:
            shape, dtype = requests[step & 1023]
            tensor = pool.try_alloc(shape, dtype)
            if tensor is not None:
                live.append(tensor)
                done += 1
    for tensor in live:
        pool.free(tensor)
    return done + len(live)


def allocator_pairs(pool: HostPool, ops: int) -> int:
    extents = ExtentAllocator(pool.capacity_bytes // pool.alignment)
    for units in range(ops // 2):
        size = 1 + units % 64
        start = extents.reserve(size)
        assert start is not None
        extents.release(start, size)
    return ops // 2 * 2


CASES: dict[str, Callable[[HostPool, int], int]] = {
    "chunk_pairs": chunk_pairs,
    "random_churn": random_churn,
    "allocator_pairs": allocator_pairs,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=int, default=200_000, help="operations per case (default: %(default)s)")
    parser.add_argument("--capacity-mib", type=int, default=1024, help="pool size, at least 32 (default: %(default)s)")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "ops")
    if args.capacity_mib < 32:
        raise BenchError(f"--capacity-mib must be at least 32 (one llama3-8b chunk object), got {args.capacity_mib}")


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(len(CASES))
    pool = HostPool(args.capacity_mib * MIB)
    rows: list[dict[str, Any]] = []
    for name, case in CASES.items():
        start = time.perf_counter()
        done = case(pool, args.ops)
        seconds = time.perf_counter() - start
        if pool.used_bytes:
            raise BenchError(f"{name} left {pool.used_bytes} bytes allocated")
        rows.append({"case": name, "ops": done, "seconds": seconds, "ops_per_s": done / seconds})
        steps.done(name)
    title = f"HostPool {pool.capacity_bytes // MIB} MiB, pinned={pool.is_pinned}, torch {torch.__version__}"
    table = new_table(title, ("case", "ops", "seconds", "ops/s", "us/op"))
    for row in rows:
        table.add_row(
            row["case"],
            f"{row['ops']:,}",
            f"{row['seconds']:.3f}",
            f"{row['ops_per_s']:,.0f}",
            f"{1e6 / row['ops_per_s']:.2f}",
        )
    config = {"ops": args.ops, "capacity_bytes": pool.capacity_bytes, "pinned": pool.is_pinned}
    return Outcome(config, rows, [table])
