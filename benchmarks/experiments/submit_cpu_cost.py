"""Question: how much CPU time does `TransferEngine.submit` (the staged path's Python) cost per request?

Answer (2026-11-29, CPU machine, engine v7): store / retrieve, one llama3-8b chunk 15-16 / 15 us, 16 chunks 40-51 /
40-45 us (engine v6: 21 us for one chunk; before the schedule cache, 78 / 50) (docs/benchmark_log.md, 2026-11-29).

Runs on any machine: the engine runs on CPU memory (`tests/transfer/cpu_engine.py`) with its copies and kernel
launches skipped, so this times only the Python that runs per request before and between them.

    python benchmarks/experiments/submit_cpu_cost.py

On the GPU machine each real driver call adds ~1-2 us and a launch ~10 us (profile_gpu_call.py times the full call).
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.transfer
from tests.transfer.cpu_engine import CopyingDriver, World, completion_init, engine_on

from kvferry.kernels import triton_copy
from kvferry.memory import HostPool
from kvferry.transfer import gpu_engine


def main() -> None:
    torch._C._cuda_getCurrentRawStream = lambda index: 0  # no CUDA here
    triton_copy.launch_raw = lambda *args, **kwargs: None  # type: ignore[assignment]
    gpu_engine.Completion.__init__ = completion_init  # type: ignore[method-assign]
    gpu_engine.Completion.__del__ = lambda self: None  # type: ignore[method-assign]
    config = gpu_engine.EngineConfig()
    engine = engine_on(World(HostPool(1 << 20, pin=False), config.slot_bytes), CopyingDriver(copies=False), config)
    # llama3-8b, format 1, every head (a stub of the Triton plan: what `submit` reads)
    plan = types.SimpleNamespace(bs=16, bytes_per_token=32 * 2 * 1024 * 2, word=8, partial_rows=False)
    cases = {
        "one llama chunk (32 MiB)": ([torch.empty((2, 32, 256, 1024), dtype=torch.bfloat16)], 16),
        "16 llama chunks": ([torch.empty((2, 32, 256, 1024), dtype=torch.bfloat16) for _ in range(16)], 256),
    }
    n = 3000
    for name, (objects, n_ids) in cases.items():
        ids = torch.randperm(4096)[:n_ids]
        for to_objects in (True, False):
            start = time.perf_counter()
            for _ in range(n):
                engine.submit(plan, objects, ids, to_objects, 256, 0, "staged")  # type: ignore[arg-type]
            per_call = (time.perf_counter() - start) / n * 1e6
            print(f"{name:26s} {'store' if to_objects else 'retrieve':8s} {per_call:6.1f} us per submit")


if __name__ == "__main__":
    main()
