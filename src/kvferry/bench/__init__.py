"""Benchmarks of kvferry's data path, each reported as a ratio to a same-run plain copy of the same bytes."""

from kvferry.bench.timing import CopyCeiling, gbps, measure_ceiling, time_call
from kvferry.bench.transfer_bench import BenchError, BenchSpec, TransferResult, make_spec, run_bench

__all__ = [
    "BenchError",
    "BenchSpec",
    "CopyCeiling",
    "TransferResult",
    "gbps",
    "make_spec",
    "measure_ceiling",
    "run_bench",
    "time_call",
]
