"""The `gemm` section of `kvferry bench gpu-transfer`: how much of the model's compute a transfer leaves it.

A bf16 8192^3 GEMM loop runs on the main stream while transfers loop on another. The GEMM's own speed drifts with
the card's power/thermal state (the first second of GEMMs ran 12% faster than the next, measured): the section
warms it up for 3 s, and compares each run beside a transfer with the mean of 1 s runs alone just before and after
it. Control: a plain pinned memcpy loop (the copy engine, no kernel). Each engine's transfer loop is checked once,
after it: what it wrote (a store's objects, a retrieve's KV, filled with random bytes before the loop) equal to the
torch backend's transfer of the same blocks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvferry import Direction
from kvferry.bench.harness import Steps
from kvferry.bench.report import new_table
from kvferry.bench.timing import PinnedCopy
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.gpu_engine import TransferEngine

if TYPE_CHECKING:
    from kvferry.bench.gpu_setup import Setup

# (mode, programs per launch, kernel stream priority) of the engines run beside the GEMMs
CONFIGS = [
    ("staged", None, 0),
    ("staged", 32, 0),
    ("staged", None, -1),
    ("staged", 32, -1),
    ("staged", 16, -1),
    ("zero_copy", None, 0),
]
STEPS = 1 + 2 * (1 + len(CONFIGS))  # the warm-up, then the control and every engine in both directions


def gemm_tflops(during: Callable[[], int] | None = None, seconds: float = 1.0) -> tuple[float, float]:
    """bf16 8192^3 GEMMs on the current stream for ~seconds while `during()` transfers loop on its own streams."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    moved = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = max(40, int(seconds / 1.6e-3))  # one 8192^3 GEMM takes ~1.6 ms on an H200
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    t0 = time.perf_counter()
    side = torch.cuda.Stream()  # the transfers' caller stream: not ordered after the GEMMs
    with torch.cuda.stream(side):
        while not end.query() and during is not None:
            moved += during()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ms = start.elapsed_time(end)
    return 2 * n**3 * iters / (ms / 1e3) / 1e12, (moved / wall / 1e9 if during is not None else 0.0)


def gemm_rows(s: Setup, steps: Steps) -> list[dict[str, Any]]:
    """One row per variant: the GEMM's TFLOP/s beside it, alone before and after, and the transfer's GB/s."""
    gemm_tflops(seconds=3.0)
    steps.done("gemm: warm-up")
    copy = PinnedCopy(s.nbytes)

    def plain(to_host: bool) -> int:
        copy.start(to_host)
        torch.cuda.current_stream().synchronize()  # the side stream only: a device sync would wait for the GEMMs
        return s.nbytes

    variants: list[tuple[str, Direction, Callable[[], int], bool]] = []  # (..., whether the loop is s's transfers)
    for d in (Direction.D2H, Direction.H2D):
        variants.append(("plain memcpy (control)", d, functools.partial(plain, d is Direction.D2H), False))
    for mode, programs, priority in CONFIGS:
        eng = TransferEngine("cuda", EngineConfig(programs=programs, kernel_priority=priority))
        label = f"{mode}{'' if programs is None else f' {programs} programs'}{' high priority' * (priority < 0)}"
        for d in (Direction.D2H, Direction.H2D):

            def loop(d: Direction = d, mode: str = mode, eng: TransferEngine = eng) -> int:
                s.run(d, eng, mode)
                return s.nbytes

            variants.append((label, d, loop, True))
    rows = []
    for label, d, during, checked in variants:
        before, _ = gemm_tflops()
        check = s.check(d, f"gemm: {label} {d.name} beside the GEMMs") if checked else None
        if check is not None:
            check.setup()
        tf, gbps = gemm_tflops(during)
        if check is not None:
            check.last()
        del check  # its reference bytes: a retrieve's are a copy of the whole KV
        after, _ = gemm_tflops()
        alone = (before + after) / 2
        rows.append(
            dict(
                section="gemm",
                what=f"{label} {d.name}",
                gemm_tflops=tf,
                gemm_alone=alone,
                gemm_alone_before=before,
                gemm_alone_after=after,
                gemm_kept=tf / alone,
                gbps=gbps,
            )
        )
        steps.done(f"gemm: {label} {d.name}")
    return rows


def gemm_table(rows: list[dict[str, Any]]) -> Any:
    table = new_table(
        "bf16 8192^3 GEMM beside a transfer loop, against the mean of GEMMs alone just before and after",
        ("beside", "GEMM TFLOP/s", "alone", "before", "after", "kept", "transfer GB/s"),
    )
    for r in rows:
        table.add_row(
            r["what"],
            f"{r['gemm_tflops']:.0f}",
            f"{r['gemm_alone']:.0f}",
            f"{r['gemm_alone_before']:.0f}",
            f"{r['gemm_alone_after']:.0f}",
            f"{r['gemm_kept']:.3f}",
            f"{r['gbps']:.1f}",
        )
    return table
