"""What a GPU request costs before its bytes move: the CPU time of its call (to its return, before the wait), and on
the GPU's timeline when its first operation starts after the call and when its last one ends.

The timeline is CUPTI's, through `torch.profiler`, over a few calls that each wait for their GPU work and then let
the GPU idle (a request arriving alone). The profiler adds CPU time to every driver call it records, so its figures
are upper bounds of an unprofiled call's; the enqueue's CPU time is timed without it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

LABEL = "kvferry call"
_GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


class Waitable(Protocol):
    def wait(self) -> None: ...


def call_timelines(events: list[dict[str, Any]], label: str = LABEL) -> list[dict[str, float]]:
    """For each call annotated `label` in a Chrome trace's events that ran GPU operations: the call's duration,
    and when its first GPU operation started and its last ended, in us after the call began."""
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    # The CPU-side span of each call: the profiler mirrors it on the GPU's timeline (category "gpu_user_annotation",
    # from its first GPU operation to its last), which is not the call.
    calls = sorted((e for e in spans if e.get("name") == label and not str(e.get("cat")).startswith("gpu_")),
                   key=lambda e: e["ts"])  # fmt: skip
    gpu = sorted((e for e in spans if e.get("cat") in _GPU_CATEGORIES), key=lambda e: e["ts"])
    out = []
    for call in calls:
        t0, t1 = call["ts"], call["ts"] + call["dur"]
        ops = [g for g in gpu if t0 <= g["ts"] < t1]
        if ops:
            out.append(
                {
                    "call_us": float(call["dur"]),
                    "first_op_us": float(ops[0]["ts"] - t0),
                    "gpu_end_us": float(max(g["ts"] + g["dur"] for g in ops) - t0),
                }
            )
    return out


def profiled_calls(call: Callable[[], object], n: int) -> list[dict[str, float]]:
    """`call` (which waits for its GPU work) `n` times under the profiler, 2 ms apart: `call_timelines` of them."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            with record_function(LABEL):
                call()
            time.sleep(0.002)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return call_timelines(events)


def enqueue_us(enqueue: Callable[[], Waitable], n: int) -> float:
    """Median CPU time from the call to its return (each request waited for before the next)."""
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        handle = enqueue()
        samples.append((time.perf_counter() - start) * 1e6)
        handle.wait()
    return statistics.median(samples)


def call_costs(enqueue: Callable[[], Waitable], n_timed: int = 50, n_traced: int = 10) -> dict[str, float | None]:
    """`enqueue_us` over `n_timed` calls, and the medians of `profiled_calls` over `n_traced` (None when the
    profiler saw no GPU operation: a driver without CUPTI's activity records, say)."""
    enqueue().wait()  # compiled, captured and cached before anything is timed
    timed = enqueue_us(enqueue, n_timed)
    traced = profiled_calls(lambda: enqueue().wait(), n_traced)

    def median(key: str) -> float | None:
        return statistics.median(t[key] for t in traced) if traced else None

    return {"enqueue_us": timed, "first_op_us": median("first_op_us"), "gpu_end_us": median("gpu_end_us")}
