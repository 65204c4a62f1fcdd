"""Rounds of a checked store and load beside a same-run pinned memcpy of the same bytes, timed alternately: what the
GPU connector benches (`vllm-gpu`, `sglang-gpu`) measure, whatever engine's path they drive."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvferry.bench.samples import Samples


class CheckedPath(Protocol):
    """A way of storing the source blocks' bytes and loading them into the destination blocks, checked."""

    def store(self) -> None: ...
    def before_load(self) -> None: ...
    def load(self) -> None: ...
    def check_load(self) -> None: ...


class ConnectorRounds(CheckedPath, Protocol):
    nbytes: int

    def next_round(self) -> None: ...


def measure(
    connector: ConnectorRounds,
    memcpy: Callable[[bool], None],
    dma: CheckedPath | None,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    settle: Callable[[], None] = lambda: None,
    span: Callable[[Callable[[], None]], float] | None = None,
    h2d_enqueue: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One warm-up round and ``repeats`` timed ones, each: a new prefix and source bytes, the connector's store, the
    D2H memcpy, the connector's load (checked), the H2D memcpy, then vLLM's page DMA store and load (checked).
    ``memcpy(to_host)``: a plain pinned copy of the same bytes, to its end. ``settle()``, before every timed call:
    waits for the work queued outside the timed calls (on a GPU: a round's new source bytes, a load's poison and
    snapshot of the KV), which a timed call ordered after it would otherwise wait for and count as its own.

    ``span`` (`kvferry.bench.timing.gpu_span`), for a load that leaves its end on the caller's stream (an engine's
    forward waits for it there, not on the host): the load and the H2D memcpy (``h2d_enqueue``, its copy enqueued on
    that stream) are timed by it instead of by ``clock``, both to the point where the stream may go on."""
    if (span is None) != (h2d_enqueue is None):
        raise ValueError("span= and h2d_enqueue= come together: the load and its memcpy are timed alike")
    samples = Samples(clock)
    h2d = h2d_enqueue or (lambda: memcpy(False))

    def timed(name: str, call: Callable[[], None]) -> None:
        settle()
        if span is not None and name in ("load", "h2d memcpy"):
            samples.record(name, span(call))
        else:
            samples.timed(name, call)

    for i in range(repeats + 1):
        if i == 1:
            samples.clear()  # the warm-up round's (checked all the same)
        connector.next_round()
        timed("store", connector.store)
        timed("d2h memcpy", lambda: memcpy(True))
        connector.before_load()
        timed("load", connector.load)
        connector.check_load()
        timed("h2d memcpy", h2d)
        if dma is not None:
            timed("page DMA store", dma.store)
            dma.before_load()
            timed("page DMA load", dma.load)
            dma.check_load()
    return results(samples, connector.nbytes, repeats + 1, dma is not None)


def results(samples: Samples, nbytes: int, checked_rounds: int, dma: bool) -> dict[str, Any]:
    """The medians in microseconds, the ratios to the memcpy of the same direction, and the connector's GB/s."""
    us = {name: samples.median(name) * 1e6 for name in samples.names}
    return {
        "mib": nbytes / 2**20,
        "checked_rounds": checked_rounds,
        "store_us": us["store"],
        "load_us": us["load"],
        "d2h_memcpy_us": us["d2h memcpy"],
        "h2d_memcpy_us": us["h2d memcpy"],
        "store_ratio": samples.ratio("d2h memcpy", "store"),
        "load_ratio": samples.ratio("h2d memcpy", "load"),
        "store_gbps": nbytes / us["store"] / 1e3,
        "load_gbps": nbytes / us["load"] / 1e3,
        "vllm_dma_store_us": us["page DMA store"] if dma else None,
        "vllm_dma_load_us": us["page DMA load"] if dma else None,
        "vllm_dma_store_ratio": samples.ratio("d2h memcpy", "page DMA store") if dma else None,
        "vllm_dma_load_ratio": samples.ratio("h2d memcpy", "page DMA load") if dma else None,
    }


STRAY = 0.03  # a ceiling whose rate is this far from the run's others was disturbed


def stray_ceilings(rows: list[dict[str, Any]], name: Callable[[dict[str, Any]], str]) -> list[str]:
    """Flag the rows whose same-run memcpy ran more than `STRAY` off the median rate of the run's rows in that
    direction (a ratio of 1.08 once came from a memcpy 20% slow beside a server's copies: the ceiling moved, not
    the transfer): each such row's ``strayed`` lists the directions, and a line per row says which ratio is not
    comparable (``name(row)``: the row as the table names it)."""
    lines = []
    for row in rows:
        row["strayed"] = []
    for direction, what in (("d2h", "store"), ("h2d", "load")):
        rates = [row["mib"] / row[f"{direction}_memcpy_us"] for row in rows]
        middle = statistics.median(rates)
        for row, rate in zip(rows, rates, strict=True):
            if abs(rate / middle - 1) > STRAY:
                row["strayed"].append(direction)
                lines.append(
                    f"{name(row)}: its {direction.upper()} memcpy ran at {rate * 2**20 / 1e3:.1f} GB/s against the"
                    f" run's {middle * 2**20 / 1e3:.1f}: its {what} ratio is not comparable (a disturbed ceiling)"
                )
    return lines
