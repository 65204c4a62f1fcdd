"""Benchmarks of kvferry, each reported against a same-run ceiling (a plain copy of the same bytes, plain I/O,
a bare ZMQ round trip); every one runs as a `kvferry bench` subcommand (see `kvferry.cli.bench_cmd`)."""

from kvferry.bench.harness import BenchError, Outcome, Steps
from kvferry.bench.timing import CopyCeiling, PinnedCopy, gbps, latency_summary, measure_ceiling, time_call
from kvferry.bench.transfer_bench import TransferResult, run_bench
from kvferry.bench.transfer_spec import BenchSpec, make_spec

__all__ = [
    "BenchError",
    "BenchSpec",
    "CopyCeiling",
    "Outcome",
    "PinnedCopy",
    "Steps",
    "TransferResult",
    "gbps",
    "latency_summary",
    "make_spec",
    "measure_ceiling",
    "run_bench",
    "time_call",
]
