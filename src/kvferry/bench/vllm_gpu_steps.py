"""`kvferry bench vllm-gpu --steps`: whether the worker side's stores hold up vLLM's step on a GPU.

A stand-in for vLLM's model step: bf16 GEMMs on the current stream (vLLM's), as many FLOPs as prefilling the stored
tokens of an 8B model, then a write of every layer of the blocks the step's store reads (attention writing their
KV), then the store started as vLLM's model runner starts it (`wait_for_save` -> `start_stores`, after the forward
pass), then a wait for the stream (vLLM reads the sampled tokens back). Two block sets take turns, and a step waits
for the store that read its set two steps before (vLLM keeps a request's blocks until its store is done): a store
slower than two steps shows as step time. The same steps without stores alternate with them (medians); the ratio is
their step times', and the CPU time `start_stores` took to return is what the store cost vLLM's thread.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from kvferry.connector.plan import StepPlan, StoreSpec

if TYPE_CHECKING:
    from kvferry.bench.vllm_connector_path import ConnectorPath

GEMM_N = 8192
STEP_GEMMS = 60  # 60 x 2 x 8192^3 = 6.6e13 FLOPs: prefilling 4096 tokens of an 8B model (2 x 8e9 x 4096)
STEPS = 8  # steps per timed run


class StandInStep:
    """The GEMMs and block writes of one model step on the current stream."""

    def __init__(self, bench: ConnectorPath, gemms: int = STEP_GEMMS, n: int = GEMM_N) -> None:
        self.bench = bench
        self.gemms = gemms
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.block_sets = [bench.src, bench.dst]
        self.kernel_ids = [
            torch.as_tensor(list(bench.kv.kernel_block_ids(ids)), device="cuda") for ids in self.block_sets
        ]

    def run(self, step: int) -> None:
        for _ in range(self.gemms):
            torch.mm(self.a, self.b, out=self.out)
        ids = self.kernel_ids[step % 2]
        for layer in self.bench.kv.layers:  # the KV the step computed, in every layer of its blocks
            layer.index_fill_(0, ids, step % 7 + 1)


def timed_steps(stand_in: StandInStep, stores: bool, steps: int = STEPS) -> tuple[list[float], list[float]]:
    """`steps` steps, with the store of each step's blocks started after it or not: (each step's seconds, each
    `start_stores` call's CPU seconds)."""
    worker, bench = stand_in.bench.worker, stand_in.bench
    stream = torch.cuda.current_stream()
    step_s: list[float] = []
    call_s: list[float] = []
    stream.synchronize()
    for step in range(steps):
        started = time.perf_counter()
        worker.preempted([f"step{step - 2}"])  # this step's blocks: the store that read them two steps ago ends
        stand_in.run(step)
        if stores:
            tokens = bench.next_prefix()
            plan = StepPlan(stores=[StoreSpec(f"step{step}", tokens, stand_in.block_sets[step % 2], 0)])
            cpu = time.thread_time()
            worker.start_stores(plan)
            call_s.append(time.thread_time() - cpu)
        stream.synchronize()
        step_s.append(time.perf_counter() - started)
    worker.preempted([f"step{steps - 2}", f"step{steps - 1}"])  # outside the timed steps: the last two stores
    return step_s, call_s


def step_stall(bench: ConnectorPath, repeats: int) -> dict[str, Any]:
    """Runs of steps with and without stores, taking turns after one warm-up of each."""
    stand_in = StandInStep(bench)
    with_stores: list[float] = []
    without: list[float] = []
    calls: list[float] = []
    for i in range(repeats + 1):
        plain, _ = timed_steps(stand_in, stores=False)
        stored, call_s = timed_steps(stand_in, stores=True)
        if i:
            without += plain
            with_stores += stored
            calls += call_s
    return summary(with_stores, without, calls, bench.nbytes)


def summary(with_stores: list[float], without: list[float], call_s: list[float], store_bytes: int) -> dict[str, Any]:
    """Median step times with and without stores, their ratio, and the CPU time of a `start_stores` call."""
    with_ms, without_ms = statistics.median(with_stores) * 1e3, statistics.median(without) * 1e3
    return {
        "steps": len(with_stores),
        "store_mib": store_bytes / 2**20,
        "step_ms": without_ms,
        "step_with_stores_ms": with_ms,
        "step_ratio": with_ms / without_ms,
        "start_stores_cpu_us": statistics.median(call_s) * 1e6,
        "start_stores_cpu_max_us": max(call_s) * 1e6,
    }


def describe_steps(mode: str, s: dict[str, Any]) -> str:
    return (
        f"{mode}: a stand-in model step of {s['step_ms']:.1f} ms took {s['step_with_stores_ms']:.1f} ms with a "
        f"{s['store_mib']:.0f} MiB store after it ({s['step_ratio']:.3f}x; {s['steps']} steps each); start_stores "
        f"returned after {s['start_stores_cpu_us']:.0f} us of CPU (max {s['start_stores_cpu_max_us']:.0f})"
    )
