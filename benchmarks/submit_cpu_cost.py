"""CPU cost of `TransferEngine.submit` (the staged path's Python), on any machine: the CUDA driver and the kernel
launches are stubbed out, so this measures only the Python that runs per request before and between them.

    python benchmarks/submit_cpu_cost.py

On the GPU machine the real driver calls add ~1-2 us each (see profile_gpu_call.py for the full call there).
"""

from __future__ import annotations

import threading
import time
import types
from collections import deque
from typing import Any

import torch

from kvferry.kernels import triton_copy
from kvferry.transfer import gpu_engine


class _StubDriver:
    """Every driver call returns at once; events are always complete."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    def query(self, event: int) -> bool:
        return True

    def current(self, context: int) -> Any:
        return _NoContext()


class _NoContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _stub_engine() -> gpu_engine.TransferEngine:
    drv = _StubDriver()
    lane = gpu_engine._Lane.__new__(gpu_engine._Lane)
    lane.__dict__.update(
        _driver=drv, ks=1, cs=2, slot_bytes=64 << 20, staging_ptr=1 << 40, slot_free=[1, 2], slot_ready=[3, 4],
        start=5, next_slot=0, meta_host=torch.empty((32, 16384), dtype=torch.int64),
        meta_dev=types.SimpleNamespace(data_ptr=lambda: 1 << 41), meta_uploaded=list(range(32)), next_meta=0,
        lock=threading.Lock(), inflight=deque(),
    )  # fmt: skip
    lane.meta_host_np = lane.meta_host.numpy()
    engine = gpu_engine.TransferEngine.__new__(gpu_engine.TransferEngine)
    engine.__dict__.update(
        device=torch.device("cuda", 0), config=gpu_engine.EngineConfig(), _driver=drv, _store=lane,
        _retrieve=lane, _context=1, _schedules={},
    )  # fmt: skip
    return engine


def _stub_completion(self: Any, drv: Any, context: int) -> None:
    self._driver, self.context, self._pool, self.event = drv, context, [], 9


def main() -> None:
    engine = _stub_engine()
    torch._C._cuda_getCurrentRawStream = lambda index: 7  # no CUDA here
    triton_copy.launch_raw = lambda *args, **kwargs: None  # type: ignore[assignment]
    gpu_engine._Completion.__init__ = _stub_completion  # type: ignore[method-assign]
    plan = types.SimpleNamespace(bs=16, bytes_per_token=32 * 2 * 1024 * 2, word=8)  # llama3-8b, format 1
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
