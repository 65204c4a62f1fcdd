"""What a GPU request costs before its bytes move, three ways:

- the CPU time of its call, to its return (before the wait);
- the time the GPU waits for the CPU: the call's wall time to completion on an idle GPU, less the GPU's own time for
  the same request enqueued behind a sleeping stream (so that all of it is queued before any of it runs). That is the
  time from the call to the request's first GPU operation, plus any gap the GPU then spends waiting for the CPU to
  enqueue the rest; no profiler is involved. It needs every GPU operation of the request ordered after the caller's
  stream: not so a staged retrieve of several slices, whose first DMAs into staging wait for nothing (they would
  run during the sleep and the GPU's time would read short);
- a CUPTI timeline (`torch.profiler`) of a few calls: when the first GPU operation starts and the last ends after the
  call. The profiler adds CPU time to every driver call it records (a llama3-8b chunk's first operation 178 us after
  its call profiled, against a 46 us call unprofiled on the H200), so these are upper bounds.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

LABEL = "kvferry call"
_GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


# GPU cycles the caller's stream sleeps while a request is queued behind it (~2 ms at the H200's clock: longer than
# any request's enqueue here)
SLEEP_CYCLES = 4_000_000


class Waitable(Protocol):
    def wait(self) -> None: ...

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None: ...


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


def gpu_wait_us(enqueue: Callable[[], Waitable], n: int) -> dict[str, float]:
    """Medians of: the call's wall time to completion on an idle GPU (`wall_us`, `n` calls back to back, as the
    ratio rows time them), the same request's time on the GPU alone (`gpu_us`, `n` more: each enqueued behind
    `SLEEP_CYCLES` of sleep on the caller's stream, timed by events from the sleep's end to the request's end), and
    their difference (`cpu_bound_us`: what the GPU waited for the CPU). Not interleaved: after each 2 ms sleep the CPU
    runs the next call cold (about twice as slow on the H200 host). The request must order itself after the caller's
    stream, as kvferry's do. Medians of separate runs: where the GPU's time is nearly all of the wall time, `gpu_us`
    can read above `wall_us` by their run-to-run spread (2452 against 2437 us on a busy host), `cpu_bound_us` below
    zero by as much."""
    walls = []
    for _ in range(n):
        start = time.perf_counter()
        enqueue().wait()
        walls.append((time.perf_counter() - start) * 1e6)
    stream = torch.cuda.current_stream()
    spans = []
    for _ in range(n):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        begin.record(stream)
        enqueue().wait_on(stream)
        end.record(stream)
        end.synchronize()
        spans.append(begin.elapsed_time(end) * 1e3)
    wall, gpu = statistics.median(walls), statistics.median(spans)
    return {"wall_us": wall, "gpu_us": gpu, "cpu_bound_us": wall - gpu}


def call_costs(
    enqueue: Callable[[], Waitable], n_timed: int = 50, n_traced: int = 10, *, ordered: bool = True
) -> dict[str, float | None]:
    """`enqueue_us` and, when every GPU operation of the request is `ordered` after the caller's stream,
    `gpu_wait_us` (else its figures are None), over `n_timed` calls; and the medians of `profiled_calls` over
    `n_traced` (None when the profiler saw no GPU operation: a driver without CUPTI's activity records, say)."""
    enqueue().wait()  # compiled, captured and cached before anything is timed
    timed = enqueue_us(enqueue, n_timed)
    no_waits: dict[str, float | None] = {"wall_us": None, "gpu_us": None, "cpu_bound_us": None}
    waits = gpu_wait_us(enqueue, n_timed) if ordered else no_waits
    traced = profiled_calls(lambda: enqueue().wait(), n_traced)

    def median(key: str) -> float | None:
        return statistics.median(t[key] for t in traced) if traced else None

    return {"enqueue_us": timed, **waits, "first_op_us": median("first_op_us"), "gpu_end_us": median("gpu_end_us")}
