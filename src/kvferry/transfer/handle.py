"""What a caller holds for an enqueued GPU transfer: a handle on the request's done-event.

`Completion` is the event itself, pooled per CUDA context (creating an event costs more CPU than recording one), and
tells its lane when it is seen to have fired, so the lane knows the metadata slot the request used is idle (no event
query needed before the next request reuses it).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from kvferry.cuda.driver import Driver

if TYPE_CHECKING:
    from kvferry.transfer.lane import Lane


class Completion:
    """A request's done-event (a raw CUDA event), back to its context's pool when its last holder lets go.

    Pooled because creating an event costs more CPU than recording one. An event only returns to the pool after
    the request has finished (the lane retires it only then, and a handle's holder is gone), so reusing it is safe.
    Whoever sees it fire tells its lane (`Lane.finished`), which then knows the metadata slot it used is idle. It
    holds the lane weakly: the lane holds it (in flight, or as a slot's last user), and a cycle would keep a dropped
    engine's staging memory until the garbage collector ran.
    """

    __slots__ = ("_driver", "_pool", "context", "event", "fired", "lane", "meta")

    def __init__(self, drv: Driver, context: int, lane: weakref.ref[Lane] | None = None) -> None:
        self._driver = drv
        self.context = context
        self._pool = _event_pools.setdefault(context, [])
        self.event = self._pool.pop() if self._pool else drv.event()
        self.lane = lane
        self.meta = -1  # its metadata slot (-1: none)
        self.fired = False  # seen fired: the lane retires it without a driver query

    def query(self) -> bool:
        if self.fired:  # seen already: polled again by whoever watches the copy's end (`kvferry.cache.steps`)
            return True
        d = self._driver
        with d.current(self.context):
            fired = d.query(self.event)
        if fired:
            self.fired = True
            self._tell_lane()
        return fired

    def synchronize(self) -> None:
        if self.fired:  # seen already (a load's rest waits once to resolve, and again in its steps)
            return
        d = self._driver
        with d.current(self.context):
            d.synchronize(self.event)  # ctypes lets go of the GIL while it blocks
        self.fired = True
        self._tell_lane()

    def _tell_lane(self) -> None:
        lane = self.lane() if self.lane is not None else None
        if lane is not None:
            lane.finished(self)

    def order(self, stream: int) -> None:
        d = self._driver
        with d.current(self.context):
            d.wait(stream, self.event, 0)

    def __del__(self) -> None:
        if getattr(self, "event", None):  # None if __init__ failed
            self._pool.append(self.event)


_event_pools: dict[int, list[int]] = {}  # context -> finished, reusable done-events


class TransferHandle:
    """Completion of one enqueued request: poll it, wait for it, or order a stream after it."""

    __slots__ = ("_completion", "mode", "nbytes")

    def __init__(self, completion: Completion, nbytes: int, mode: str) -> None:
        self._completion = completion
        self.nbytes = nbytes
        self.mode = mode

    def done(self) -> bool:
        return self._completion.query()

    def wait(self) -> None:
        """Block the calling CPU thread until the bytes have moved."""
        self._completion.synchronize()

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for this transfer, without blocking the CPU."""
        self._completion.order((stream or torch.cuda.current_stream()).cuda_stream)
