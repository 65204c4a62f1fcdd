"""`kvferry.bench.gpu_timeline`: a call's GPU operations read off a Chrome trace, and the enqueue's CPU time. The
profiled run itself needs a GPU (`test_bench_gpu.py`)."""

from __future__ import annotations

import pytest

from kvferry.bench import gpu_timeline
from kvferry.bench.gpu_timeline import LABEL, call_timelines, enqueue_us


def _span(name: str, ts: float, dur: float, cat: str = "user_annotation") -> dict[str, object]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_each_call_gets_the_gpu_operations_that_ran_inside_it() -> None:
    events = [
        _span(LABEL, 1000.0, 100.0),
        _span(LABEL, 1030.0, 62.0, "gpu_user_annotation"),  # the profiler's mirror of the call on the GPU
        _span("gather", 1030.0, 10.0, "kernel"),
        _span("Memcpy DtoH", 1042.0, 50.0, "gpu_memcpy"),
        _span("cuLaunchKernel", 1005.0, 3.0, "cuda_driver"),  # a CPU-side driver call: not a GPU operation
        _span("model", 1500.0, 30.0, "kernel"),  # between the calls: nobody's
        _span(LABEL, 2000.0, 80.0),
        _span("Memcpy HtoD", 2011.0, 40.0, "gpu_memcpy"),
        _span("scatter", 2052.0, 5.0, "kernel"),
        _span(LABEL, 3000.0, 20.0),  # no GPU operation inside: left out
        {"ph": "i", "name": LABEL, "ts": 4000.0},  # an instant event: not a span
    ]
    assert call_timelines(events) == [
        {"call_us": 100.0, "first_op_us": 30.0, "gpu_end_us": 92.0},
        {"call_us": 80.0, "first_op_us": 11.0, "gpu_end_us": 57.0},
    ]
    assert call_timelines(events, "another label") == []


def test_the_enqueue_is_timed_to_the_return_and_each_request_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(float(t) for t in (0, 10e-6, 100, 100 + 30e-6, 200, 200 + 20e-6))
    monkeypatch.setattr(gpu_timeline.time, "perf_counter", lambda: next(clock))
    waits: list[int] = []

    class Handle:
        def wait(self) -> None:
            waits.append(1)

    assert enqueue_us(Handle, 3) == pytest.approx(20.0)
    assert len(waits) == 3


def test_a_call_without_gpu_operations_has_no_timeline() -> None:
    """The profiled path end to end on the CPU: the trace is written and read, and no GPU operation is found."""
    assert gpu_timeline.profiled_calls(lambda: sum(range(100)), 2) == []


def test_the_gpu_time_is_the_request_behind_a_sleeping_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpu_wait_us` on a faked GPU: calls timed on the wall clock back to back, then the request queued behind a sleep
    between two timing events on the caller's stream; the difference of their medians is the GPU's wait for the CPU."""
    log: list[str] = []
    clock = iter(float(t) for t in (0, 100e-6, 1, 1 + 120e-6, 2, 2 + 110e-6))  # the calls' starts and ends
    spans = iter((70.0, 80.0, 60.0))

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self, stream: object) -> None:
            log.append(f"record on {stream}")

        def synchronize(self) -> None:
            log.append("synchronize")

        def elapsed_time(self, end: Event) -> float:
            return next(spans) / 1e3  # ms, as torch's

    class Handle:
        def wait(self) -> None:
            log.append("wait")

        def wait_on(self, stream: object) -> None:
            log.append(f"wait_on {stream}")

    def enqueue() -> Handle:
        log.append("call")
        return Handle()

    monkeypatch.setattr(gpu_timeline.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(gpu_timeline.torch.cuda, "current_stream", lambda: "caller")
    monkeypatch.setattr(gpu_timeline.torch.cuda, "Event", Event)
    monkeypatch.setattr(gpu_timeline.torch.cuda, "_sleep", lambda cycles: log.append(f"sleep {cycles}"))
    got = gpu_timeline.gpu_wait_us(enqueue, 3)
    assert got == pytest.approx({"wall_us": 110.0, "gpu_us": 70.0, "cpu_bound_us": 40.0})
    behind_sleep = [f"sleep {gpu_timeline.SLEEP_CYCLES}", "record on caller", "call", "wait_on caller",
                    "record on caller", "synchronize"]  # fmt: skip
    assert log == ["call", "wait"] * 3 + behind_sleep * 3


def test_a_request_not_wholly_ordered_after_the_callers_stream_gets_no_gpu_wait() -> None:
    """`call_costs(ordered=False)` never sleeps a stream (runs on the CPU): the enqueue timed, the rest None."""

    class Handle:
        def wait(self) -> None:
            pass

    costs = gpu_timeline.call_costs(Handle, n_timed=3, n_traced=2, ordered=False)
    assert costs["enqueue_us"] is not None and costs["enqueue_us"] >= 0
    assert {k: v for k, v in costs.items() if k != "enqueue_us"} == dict.fromkeys(
        ("wall_us", "gpu_us", "cpu_bound_us", "first_op_us", "gpu_end_us")
    )
