"""CPU copy jobs spread over threads: numpy row scatters always, torch row gathers where the process asks for it.

torch has no fast row scatter (its CPU `index_copy_`/`index_put_` copy element by element, ~0.25 of a memcpy), so a
retrieve is numpy's `rows[index] = values` on Python threads (numpy releases the GIL). A store's
`torch.index_select` runs on torch's own OpenMP threads, except in a process that calls `use_own_threads` (the
server): libgomp's threads spin for milliseconds after every parallel op (its default wait policy), and on the
CPU machine a retrieve's scatter right after a store took 12-14 ms instead of 7-8 while one spun on the other core.
Such a process runs every copy, both directions, on kvferry's threads, which sleep when idle.

In an engine's process, kvferry's own threads (the cache engine's, the copy pool's) run torch on one thread each
(`torch_on_one_thread`) and copy over threads of their own, as the server does. A torch op parallel on such a
thread would start an OpenMP team of its own; libgomp then counts more threads than CPUs and, for as long as those
threads live, cuts the spin of every team, the engine's too, to ~100 iterations: the engine's OpenMP threads then
sleep on a futex between its parallel ops and wait to be woken at the next (vLLM's CPU worker: ~1,200 such sleeps in
a 16-prompt batch instead of ~50; a loop of small torch ops: 24,000 instead of 50 once another thread had run one
`index_select`), and on a busy machine each wake-up waits for the core.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

_MIN_PART_BYTES = 1 << 20  # below this, a copy is not worth splitting across threads
_own_threads: int | None = None
_this_thread = threading.local()  # copy_threads: set on a thread that `torch_on_one_thread` made single-threaded


class CopyJob(Protocol):
    """A copy that can be cut into spans and run on any thread."""

    @property
    def nbytes(self) -> int: ...

    def run(self) -> None: ...

    def split(self, parts: int) -> Sequence[CopyJob]: ...


class Scatter(NamedTuple):
    """`rows[..., at, ...] = values` with `at` on `axis`: block pieces of one object or one run of objects
    (`at` may have several axes, `values` those axes and then a piece's)."""

    rows: np.ndarray
    at: np.ndarray  # not `index`: a NamedTuple field would hide tuple.index
    values: np.ndarray
    axis: int = 0

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def run(self) -> None:
        self.rows[(slice(None),) * self.axis + (self.at,)] = self.values

    def split(self, parts: int) -> list[Scatter]:
        bounds = np.linspace(0, len(self.at), parts + 1, dtype=np.int64)
        at = (slice(None),) * self.axis
        return [self._replace(at=self.at[a:b], values=self.values[(*at, slice(a, b))])
                for a, b in itertools.pairwise(bounds)]  # fmt: skip


class Gather(NamedTuple):
    """`out = rows[at]` along the first axis, written in place (`out` a view of the objects' pieces)."""

    rows: torch.Tensor
    at: torch.Tensor
    out: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.out.numel() * self.out.element_size()

    def run(self) -> None:
        torch.index_select(self.rows, 0, self.at, out=self.out)

    def split(self, parts: int) -> list[Gather]:
        bounds = np.linspace(0, len(self.at), parts + 1, dtype=np.int64).tolist()
        return [self._replace(at=self.at[a:b], out=self.out[a:b]) for a, b in itertools.pairwise(bounds)]


def use_own_threads(threads: int) -> None:
    """Run this process's CPU copies, stores too, on `threads` kvferry threads, and torch's ops on one thread: for a
    process whose torch work is kvferry's copies (the server), never for an engine's."""
    global _own_threads
    if threads < 1:
        raise ValueError(f"threads={threads} must be at least 1")
    torch.set_num_threads(1)
    _own_threads = threads


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, e.g. a container's cpuset), where the OS says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def torch_on_one_thread() -> None:
    """Make torch's ops on the calling thread (one of kvferry's) run on it alone, and its CPU copies spread over
    kvferry's threads, as many as torch's ops use elsewhere: the initializer of kvferry's threads. Where the OpenMP
    runtime is not reachable (no `omp_set_num_threads` in the process) the thread stays as it was."""
    threads = torch.get_num_threads()  # this thread's first torch call: the process's count
    if threads > 1 and _omp_set_num_threads(1) and torch.get_num_threads() == 1:
        _this_thread.copy_threads = threads


def _omp_set_num_threads(threads: int) -> bool:
    """OpenMP's `omp_set_num_threads` (this thread's team size) in the runtime loaded with torch; False without it."""
    try:
        set_num_threads = ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError, TypeError):
        return False
    set_num_threads(threads)
    return True


def copy_threads() -> int | None:
    """Threads a CPU copy on this thread spreads over on kvferry's threads (`use_own_threads`, or a thread made
    single-threaded by `torch_on_one_thread`); None: torch's ops spread it over torch's threads."""
    return _own_threads if _own_threads is not None else getattr(_this_thread, "copy_threads", None)


def on_own_threads() -> bool:
    """Whether CPU copies on this thread run on kvferry's threads (`copy_threads`), torch's ops on one thread."""
    return copy_threads() is not None


def run(jobs: Sequence[CopyJob]) -> None:
    """Every job, spread over the copy threads, the caller's one of them.

    Threads take whole jobs and meet once at the end: splitting every job across the threads and waiting after
    each (0.6-0.7 of memcpy) idles a thread whenever its half runs slower; this reaches 0.8-1.0 for row jobs. Fewer
    jobs than threads are cut into spans instead. Jobs of many short runs (a head's 256 bytes in HND layouts,
    2-byte elements of a transposed K) are CPU work more than memory traffic: two threads lift an HND retrieve
    from 0.44-0.48 to 0.68-0.72 of memcpy. The caller takes jobs too, instead of waiting for the pool: one
    hand-over less (a 3 MiB gather on two threads 0.25-0.31 ms against 0.32-0.45, CPU machine).
    """
    threads = copy_threads() or torch.get_num_threads()
    workers = min(threads, max(1, sum(job.nbytes for job in jobs) // _MIN_PART_BYTES))
    if len(jobs) < workers:
        jobs = [span for job in jobs for span in job.split(-(-workers // len(jobs)))]
    queue = iter(jobs)  # one iterator shared by every thread: a list iterator's next() is atomic under the GIL

    def take_jobs() -> None:
        for job in queue:
            job.run()

    helpers = [pool(workers - 1).submit(take_jobs) for _ in range(workers - 1)]
    try:
        take_jobs()
    finally:
        for helper in helpers:
            helper.result()  # waited for even when a job failed here: no thread may still write after we return


@functools.cache
def pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """`workers` copy threads beside the caller's (made once per count)."""
    return concurrent.futures.ThreadPoolExecutor(workers, "kvferry-copy", initializer=torch_on_one_thread)


# A forked child inherits the executors but not their threads: it must make its own.
os.register_at_fork(after_in_child=pool.cache_clear)
