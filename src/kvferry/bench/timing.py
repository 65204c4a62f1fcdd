"""Timers, latency summaries, and the copy ceilings a benchmark is compared with.

The ceiling is a plain copy of the same number of bytes between the same kinds of memory, measured in the same run
(alternating with the transfer being measured) so that whatever load the machine is under hits both alike:
- CPU: the fastest of `numpy.copyto` (a single-threaded memcpy), the same split over a thread per usable CPU, and
  `torch.Tensor.copy_` between two plain, pre-faulted, page-aligned buffers. torch's copy leaves its OpenMP
  threads spinning for milliseconds (libgomp's default wait policy), which on a small machine takes a core from
  whatever runs next: each round of ceiling copies ends with a pause (`OPENMP_SETTLE_S`) so that the call measured
  after it does not share the cores;
- CUDA: a pinned host <-> device `copy_(non_blocking=True)` (the copy engine), timed with CUDA events
  (`CopyCeiling`), or by wall clock from the call to a synchronize (`PinnedCopy`), as the GPU benchmarks time
  whole calls of kvferry's API.
"""

from __future__ import annotations

import itertools
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvferry.kernels.cpu_threads import pool, usable_cpus

DIRECTIONS = ("d2h", "h2d")
_PAGE = 4096
# After a parallel torch op on the CPU machine (2 cores), a numpy copy on two threads ran at 0.55-0.6 of its speed
# with a 1 ms pause, 0.75 with 5 ms and at full speed with 20 ms.
OPENMP_SETTLE_S = 0.03


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn` takes; on CUDA measured with events on the current stream, after a synchronize."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def elapsed_us(fn: Callable[[], object]) -> float:
    """Wall microseconds of one call of `fn` (it synchronizes itself where a device is involved)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def median_us(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall microseconds of `repeats` calls of `fn`, each after an untimed `setup()` if given."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        samples.append(elapsed_us(fn))
    return statistics.median(samples)


def latency_summary(samples_s: Sequence[float]) -> dict[str, float]:
    """p50, p99 and mean in microseconds of per-request wall times, and the request rate they add up to."""
    us = np.array(samples_s) * 1e6
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "mean_us": float(us.mean()),
        "req_per_s": float(len(us) / (us.sum() / 1e6)),
    }


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s of moving `nbytes` once (each byte read once and written once)."""
    return nbytes / seconds / 1e9


class CopyCeiling:
    """Plain copies of `nbytes` between two buffers of the memories a `direction` transfer on `device` moves between.

    `time_once()` runs every method once and records its time, so a caller can alternate it with the transfer it
    measures; `best()` is the fastest method by median.
    """

    def __init__(self, device: torch.device, nbytes: int, direction: str) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r} must be one of {DIRECTIONS}")
        if nbytes <= 0:
            raise ValueError(f"nbytes={nbytes} must be positive")
        self.device = device
        self.nbytes = nbytes
        self._methods: dict[str, Callable[[], object]] = {}
        if device.type == "cuda":
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2)
            src, dst = (dev, host) if direction == "d2h" else (host, dev)
            self._methods["pinned<->device copy_"] = lambda: dst.copy_(src, non_blocking=True)
        else:
            src_t, dst_t = _host_buffer(nbytes, 1), _host_buffer(nbytes, 2)
            src_np, dst_np = src_t.numpy(), dst_t.numpy()
            threads = usable_cpus()
            if threads > 1:  # a memcpy on every CPU, whatever torch's own thread count (the server sets it to 1)
                bounds = [nbytes * i // threads // _PAGE * _PAGE for i in range(threads)] + [nbytes]
                parts = [(dst_np[a:b], src_np[a:b]) for a, b in itertools.pairwise(bounds)]
                copies = pool(threads)
                self._methods[f"numpy.copyto on {threads} threads"] = lambda: list(
                    copies.map(lambda part: np.copyto(*part), parts)
                )
            self._methods["numpy.copyto"] = lambda: np.copyto(dst_np, src_np)
            self._methods["torch copy_"] = lambda: dst_t.copy_(src_t)
        self.samples: dict[str, list[float]] = {name: [] for name in self._methods}

    def time_once(self) -> None:
        for name, fn in self._methods.items():
            self.samples[name].append(time_call(fn, self.device))
        if self.device.type == "cpu":
            time.sleep(OPENMP_SETTLE_S)

    def clear(self) -> None:
        """Forget the samples so far (e.g. a warm-up)."""
        for samples in self.samples.values():
            samples.clear()

    def best(self) -> tuple[str, float]:
        """(method, median seconds) of the fastest method; needs at least one `time_once()`."""
        medians = {name: statistics.median(s) for name, s in self.samples.items() if s}
        if not medians:
            raise RuntimeError("no ceiling samples yet: call time_once() first")
        name = min(medians, key=medians.__getitem__)
        return name, medians[name]


class PinnedCopy:
    """A pinned host buffer and a device buffer of `nbytes`; calling it copies once between them (torch's `copy_`,
    i.e. cudaMemcpyAsync on the copy engine) and synchronizes: the ceiling of a GPU call timed by wall clock."""

    def __init__(self, nbytes: int, device: str | torch.device = "cuda") -> None:
        self.nbytes = nbytes
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)

    def __call__(self, to_host: bool) -> None:
        self.start(to_host)
        torch.cuda.synchronize()

    def start(self, to_host: bool) -> None:
        """Enqueue the copy on the current stream, without waiting for it."""
        if to_host:
            self.host.copy_(self.dev, non_blocking=True)
        else:
            self.dev.copy_(self.host, non_blocking=True)


def _host_buffer(nbytes: int, fill: int) -> torch.Tensor:
    """A plain host buffer from torch's allocator (as engine caches and the host pool are), starting on a page.

    Page-aligned like the pool's chunk objects: memcpy's speed here depends on where the destination starts in its
    page (measured on this project's CI machine: about 10 GB/s page-aligned, 2-5 GB/s at offsets 16 or 64), and
    the ceiling should be the best plain copy. Filled, so that first-touch page faults are paid here.
    """
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE
    return raw[start : start + nbytes].fill_(fill)


def measure_ceiling(device: str | torch.device, nbytes: int, direction: str, repeats: int = 5) -> float:
    """GB/s of the best plain copy of `nbytes` between the memories of a `direction` transfer on `device`.

    Standalone, not interleaved with a transfer: one warm-up, then the median of `repeats` runs.
    """
    ceiling = CopyCeiling(torch.device(device), nbytes, direction)
    ceiling.time_once()
    ceiling.clear()
    for _ in range(repeats):
        ceiling.time_once()
    return gbps(nbytes, ceiling.best()[1])


def synchronize() -> None:
    """Wait for the current CUDA device's queued work (`kvferry.bench.rounds.measure`'s ``settle``)."""
    torch.cuda.synchronize()


def gpu_span(call: Callable[[], object]) -> float:
    """Seconds by the GPU's clock from an event recorded on the current stream before ``call`` to one recorded after
    it: for a call that leaves its end on that stream (what is queued there next waits for its work), the time until
    that work may go on, the host's work before it included (the GPU is idle when the call begins) and its wake-up
    after it left out."""
    return time_call(call, torch.device("cuda", torch.cuda.current_device()))


def wake_up_us(samples: int = 200, gap_s: float = 0.002) -> float:
    """How long this host takes to wake a thread blocked on a socket: the median time from a send on a Unix socket
    pair to the receiving thread running again, each send ``gap_s`` after the last (the receiver asleep by then).

    A transfer through a local server pays one such wake-up before the server starts it (its socket thread waits
    for requests), and a hand-off to a sleeping thread pays one: the floor under those paths on this host. Measured
    ~4 us on a bare CPU machine and ~170 us inside the VM of the H100 host, where a spinning receiver took 3-8 us."""
    sender, receiver = socket.socketpair()
    delays: list[float] = []

    def receive() -> None:
        for _ in range(samples):
            data = receiver.recv(8)
            if len(data) != 8:  # the sender gave up
                return
            delays.append(time.perf_counter() - struct.unpack("d", data)[0])

    thread = threading.Thread(target=receive, name="kvferry-bench-wake", daemon=True)
    thread.start()
    try:
        for _ in range(samples):
            time.sleep(gap_s)
            sender.send(struct.pack("d", time.perf_counter()))
        thread.join()
    finally:
        sender.close()
        receiver.close()
    return statistics.median(delays) * 1e6


def wake_up_line(us: float, more: str = "", busy_poll_us: int = 0) -> str:
    """`wake_up_us`'s figure as a GPU benchmark prints it under its table (``more``: what else pays one), and
    whether the server polled after each request (``busy_poll_us``: its ``--busy-poll-us``)."""
    waits = (
        f"the server polled {busy_poll_us} us after each request (--busy-poll-us), so a transfer arriving meanwhile"
        " found it awake"
        if busy_poll_us
        else "a transfer through the server waits for one such wake-up before it starts"
    )
    return f"this host wakes a thread blocked on a socket in {us:.0f} us (median of sends 2 ms apart): {waits}{more}"
