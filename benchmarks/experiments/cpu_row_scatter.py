"""Question: which row scatter (a retrieve into an engine's KV on the CPU) is fastest, and with how many threads,
on this host: numpy's fancy assignment over typed rows `[n, 16, 128]` or over rows of one `void` item each, or
torch's `index_copy_` over 8-byte words (OpenMP)? 12288 rows of 4 KiB (16 qwen2.5-0.5b chunks) into 200 MB at random.

Answer (2026-12-01; ratio to a torch copy of the same 48 MiB): no single winner. CPU machine (2 cores): numpy on two
threads 0.67-0.81 (typed and void alike), `index_copy_` 0.47-0.60. H200 host (16 CPUs, where 48 MiB copies from its
caches in 0.64 ms): numpy best on 8 threads, 0.44-0.50 (16 threads: 0.36-0.42; 1: 0.06), `index_copy_` 0.60-0.66.
kvferry keeps numpy on a thread per CPU; a many-core host would gain ~1.3x on retrieves from `index_copy_`.

    PYTHONPATH=src python3 benchmarks/experiments/cpu_row_scatter.py
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvferry.kernels.cpu_threads import pool, usable_cpus

ROW_BYTES, ROWS, SPAN_ROWS = 4096, 12288, 48 * 1024


def median_ms(fn: Callable[[], object], repeats: int = 15) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def on_threads(threads: int, index: np.ndarray, rows: np.ndarray, values: np.ndarray) -> Callable[[], object]:
    bounds = np.linspace(0, len(index), threads + 1, dtype=np.int64)
    parts = [(index[a:b], values[a:b]) for a, b in itertools.pairwise(bounds)]

    def scatter(part: tuple[np.ndarray, np.ndarray]) -> None:
        rows[part[0]] = part[1]

    if threads == 1:
        return lambda: scatter(parts[0])
    workers = pool(threads)
    return lambda: list(workers.map(scatter, parts))


def main() -> None:
    span = torch.randint(0, 1000, (SPAN_ROWS * ROW_BYTES // 2,), dtype=torch.int16)
    values = torch.randint(0, 1000, (ROWS, ROW_BYTES // 2), dtype=torch.int16)
    index = np.random.default_rng(0).permutation(SPAN_ROWS)[:ROWS].astype(np.int64)
    typed = span.numpy().reshape(SPAN_ROWS, 16, 128)
    void = span.numpy().view(np.dtype((np.void, ROW_BYTES)))
    values_typed = values.numpy().reshape(ROWS, 16, 128)
    values_void = values.numpy().view(np.dtype((np.void, ROW_BYTES)))
    src, dst = torch.ones(ROWS * ROW_BYTES, dtype=torch.uint8), torch.zeros(ROWS * ROW_BYTES, dtype=torch.uint8)
    words, index_t = span.view(torch.int64).view(SPAN_ROWS, -1), torch.from_numpy(index)
    print(f"{usable_cpus()} CPUs; torch threads {torch.get_num_threads()}")
    for _ in range(2):
        memcpy = median_ms(lambda: dst.copy_(src))
        time.sleep(0.05)
        line = [f"memcpy {memcpy:.2f} ms"]
        for threads in sorted({1, 2, 4, 8, usable_cpus()} & set(range(1, usable_cpus() + 1))):
            a = median_ms(on_threads(threads, index, typed, values_typed))
            b = median_ms(on_threads(threads, index, void, values_void.reshape(-1)))
            line.append(f"x{threads}: typed {memcpy / a:.2f} void {memcpy / b:.2f}")
        c = median_ms(lambda: words.index_copy_(0, index_t, values.view(torch.int64)))
        line.append(f"index_copy_ int64 {memcpy / c:.2f}")
        print("; ".join(line))


if __name__ == "__main__":
    main()
