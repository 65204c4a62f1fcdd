"""Timing samples recorded under the name of what was timed, at the call that was timed; their medians and ratios.

A benchmark that alternates several operations (a transfer, the memcpy it is compared with, another path moving the
same bytes) records each sample with `Samples.timed(name, fn)` where it makes the call. Nothing is matched up by
position afterwards, so a change in the order of the calls cannot put one operation's times under another's name.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

from kvferry.bench.harness import BenchError

T = TypeVar("T")


class Samples:
    """Seconds per named operation. ``clock``: where the time comes from (a test passes a fake one)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._seconds: dict[str, list[float]] = {}

    def timed(self, name: str, fn: Callable[[], T]) -> T:
        """Call ``fn`` and record how long it took under ``name``; returns what it returned. Whatever must not be
        timed (setting up, checking the result) belongs outside ``fn``."""
        started = self._clock()
        result = fn()
        self._seconds.setdefault(name, []).append(self._clock() - started)
        return result

    def record(self, name: str, seconds: float) -> None:
        """Record under ``name`` a time taken by another clock at the call (`kvferry.bench.timing.gpu_span`)."""
        self._seconds.setdefault(name, []).append(seconds)

    def clear(self) -> None:
        """Forget every sample so far (a warm-up's)."""
        self._seconds.clear()

    @property
    def names(self) -> list[str]:
        return list(self._seconds)

    def count(self, name: str) -> int:
        return len(self._seconds.get(name, ()))

    def median(self, name: str) -> float:
        """Median seconds of ``name``'s samples."""
        samples = self._seconds.get(name)
        if not samples:
            raise BenchError(f"no timing samples of {name!r} (recorded: {', '.join(self._seconds) or 'none'})")
        return statistics.median(samples)

    def ratio(self, reference: str, measured: str) -> float:
        """Median ``reference`` over median ``measured``: the share of the reference's speed ``measured`` reaches
        (1.0: as fast). Both must have been timed as often: they alternate in one loop."""
        if self.count(reference) != self.count(measured):
            raise BenchError(
                f"{self.count(reference)} samples of {reference!r} but {self.count(measured)} of {measured!r}: "
                "a ratio needs the two timed alternately, as often"
            )
        return self.median(reference) / self.median(measured)
