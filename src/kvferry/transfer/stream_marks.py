"""Where a thread's current CUDA stream stands, as a pooled raw event: what a transfer's copies enqueued later, on
another thread, wait for (`kvferry.transfer.ordered_after`).

An engine's connector marks vLLM's stream on every store and load it starts, so that whatever part of the transfer
runs later on a worker thread is ordered after the forward pass. Pooled: no event is made per transfer. The record
itself took ~40 us of the H100 host's time on vLLM's stream (a torch event made and recorded there, the same),
which is why a transfer started on the caller's thread records its mark once its copy is in flight
(`kvferry.cache.steps.submitted`). An event goes back to the pool once the transfer that waits for it has finished:
by then every wait on it is enqueued (a wait takes the event's state when it is enqueued), so recording it again
cannot reorder them.

A thread inside an `ordered_after` block stands where that block's event is: its mark is that event. And work that
must wait for several streams (an SGLang offload: the scheduler's stream and the forward's) waits for one mark made
on a stream of the pool's that waits for each of them (`record_on`), with no stream of the caller's switched: torch's
`torch.cuda.stream` around the work and a torch event per stream cost an SGLang offload ~140 us of the scheduler's
time on the H100 host before its first copy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvferry.cuda.driver import driver, primary_context
from kvferry.transfer.api import ordering_event


class StreamMark:
    """One recorded event (`cuda_event`, a raw `CUevent`, as `torch.cuda.Event.cuda_event`); `release` it once
    the work ordered after it is enqueued. Without ``marks`` the event is lent (an `ordered_after` block's: its
    owner keeps it) and `release` does nothing."""

    __slots__ = ("_marks", "cuda_event")

    def __init__(self, marks: StreamMarks | None, event: int) -> None:
        self._marks: StreamMarks | None = marks
        self.cuda_event = event

    def release(self, _: Any = None) -> None:
        """Back to the pool (once; later calls do nothing). Takes and ignores one argument: a future's done
        callback."""
        marks, self._marks = self._marks, None
        if marks is not None:
            marks.give_back(self.cuda_event)


class StreamMarks:
    """A pool of timing-free events on one device's primary context (torch's)."""

    def __init__(self, device: torch.device) -> None:
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._driver = driver()
        self._context = primary_context(torch.device("cuda", self._index))
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._closed = False
        self._join: torch.cuda.Stream | None = None  # where `record_on` waits for several streams

    def record(self) -> StreamMark:
        """Where the calling thread's transfers are ordered: an event recorded on its current stream of the device,
        or, inside an `ordered_after` block, that block's event."""
        lent = ordering_event()
        if lent is not None:
            return StreamMark(None, lent)
        return self._record(torch._C._cuda_getCurrentRawStream(self._index))

    def record_on(self, streams: Sequence[int]) -> StreamMark:
        """A mark reached once the work queued so far on each of ``streams`` (raw `CUstream` handles of the
        device, one at least) has run: recorded on the one stream, or on a stream of the pool's that waits for
        each of them (theirs are left as they are)."""
        if len(streams) <= 1:
            if not streams:
                raise ValueError("record_on needs a stream to mark")
            return self._record(streams[0])
        if self._join is None:
            self._join = torch.cuda.Stream(torch.device("cuda", self._index))
        join, d = self._join.cuda_stream, self._driver
        with d.current(self._context):
            for stream in streams:  # an event per stream, back in the pool once the join's wait took its state
                each = self._record(stream)
                try:
                    d.wait(join, each.cuda_event, 0)
                finally:
                    each.release()
        return self._record(join)

    def _record(self, stream: int) -> StreamMark:
        """A pooled event recorded on ``stream``."""
        with self._lock:
            event = self._free.pop() if self._free else 0
        d = self._driver
        with d.current(self._context):
            if not event:
                event = d.event()
            try:
                d.record(event, stream)
            except BaseException:
                self.give_back(event)
                raise
        return StreamMark(self, event)

    def give_back(self, event: int) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(event)
                return
        self._destroy([event])

    def close(self) -> None:
        """Destroy the events in the pool (those still out are destroyed when they come back after this)."""
        with self._lock:
            free, self._free, self._closed = self._free, [], True
        self._destroy(free)

    def _destroy(self, events: list[int]) -> None:
        d = self._driver
        with d.current(self._context):
            for event in events:
                d.destroy(event)
