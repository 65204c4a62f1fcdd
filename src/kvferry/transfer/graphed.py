"""One whole chunk object's staged transfer as a CUDA graph, captured once per request shape and replayed.

Why: a one-chunk request is the latency-bound case. Launched piece by piece from Python, its gather and DMAs leave
the copy engine idle between them and one 3 MiB qwen2.5-0.5b store reaches 0.78 of a memcpy; the same pieces as one
captured graph reach 0.89-0.93, and llama3-8b's 32 MiB 0.97-0.99 (H200). The
graph splits the object into row ranges on two streams, so each range's DMA overlaps the next range's gather (a
store) or the previous range's scatter (a retrieve).

What varies per request, and how it reaches a graph captured with other values:
- the block ids: the caller uploads them into the graph's device table before each launch, on the one stream the
  graph is launched on, so a launch never reads another's ids (launches of one graph also run one at a time);
- the object's address: the graph's host copies are re-aimed before each launch (`CapturedGraph.aim`).
A graph stages in the first staging slot of its lane and is launched on that slot's stream, so stream order keeps
it apart from the staged requests using the slot (and allocates nothing: allocating device memory synchronises the
device). The engine's KV addresses are baked into the kernels, which is why graphs live on the plan
(`TritonPlan.graphs`), built for one engine KV cache.
"""

from __future__ import annotations

import itertools

import torch

from kvferry.cuda.driver import CudaError, Driver
from kvferry.cuda.graphs import CapturedGraph, HostCopy
from kvferry.kernels import triton_copy, triton_plan
from kvferry.transfer.schedule import MiB


def pieces_for(nbytes: int, rows: int, to_objects: bool) -> int:
    """Row ranges per object. H200, graphs of one / two / four ranges: a 3 MiB store 0.88-0.91 /
    0.93-0.95 / 0.90-0.97 of a memcpy, a retrieve 0.86-0.99 / 0.89-0.93 / 0.80-0.84 (its DMA comes first, and a
    range's scatter is short); a 32 MiB store 0.96-0.97 / 0.97-0.99 / 0.97-0.99, a retrieve 0.96-0.97 / 0.97-0.98 /
    0.97-0.98. Each node costs launch time (a four-range graph's replay 10-36 us of CPU against 7-16 for two): two
    ranges, one for a small retrieve."""
    return min(rows, 1 if nbytes <= 8 * MiB and not to_objects else 2)


def tables_bytes(n_ids: int) -> int:
    """Device bytes of a graph's tables (block ids, the object's offset and capacity), 256-byte aligned."""
    return -(-(n_ids + 2) * 8 // 256) * 256


class ObjectGraph:
    """The captured transfer of one object of `cap` tokens (all of them) in one direction, for one plan and lane."""

    def __init__(
        self,
        drv: Driver,
        context: int,
        plan: triton_plan.TritonPlan,
        *,
        n_ids: int,
        cap: int,
        rows: int,
        chunk_size: int,
        to_objects: bool,
        programs: int | None,
        stream: int,
        slot: int,
        host: int,
    ) -> None:
        """Capture the transfer with the object at `host` (a pinned object of the first request; nothing moves
        during a capture). `stream`: where every launch of it goes; `slot`: the device memory it stages in, the
        staging slot whose work runs on `stream` (`tables_bytes(n_ids)` + the object's bytes; stream order keeps
        the slot's other users apart). No device memory is allocated: that would synchronise the device, and the
        caller's stream may be queued behind the model for a long time."""
        self._driver = drv
        self.stream = stream
        self.n_ids = n_ids
        device = plan.stripes[0].base.device
        self.nbytes = rows * cap * plan.width * plan.element_size
        row_bytes = self.nbytes // rows
        capture_stream, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
        # ids, then the one object's offset in words (0) and its capacity: uploaded with every launch, as the slot's
        # other users overwrite them
        self._tables_ptr = tables = slot
        staging = slot + tables_bytes(n_ids)
        off, caps = tables + n_ids * 8, tables + (n_ids + 1) * 8
        pieces = pieces_for(self.nbytes, rows, to_objects)
        cuts = [rows * i // pieces for i in range(pieces + 1)]
        events = [drv.event() for _ in range(pieces + 1)]
        main, other = capture_stream.cuda_stream, side.cuda_stream
        n_rows = n_ids * plan.bs

        def enqueue() -> None:
            if not to_objects:  # the DMAs' stream joins the capture
                drv.record(events[pieces], main)
                drv.wait(other, events[pieces], 0)
            for i, (r0, r1) in enumerate(itertools.pairwise(cuts)):
                at, size = r0 * row_bytes, (r1 - r0) * row_bytes
                if to_objects:  # gather a range, then its DMA beside the next range's gather
                    triton_copy.launch_raw(plan, main, staging, off, caps, tables, True, chunk_size, 0, n_rows,
                                           (r0, r1), 0, programs)  # fmt: skip
                    drv.record(events[i], main)
                    drv.wait(other, events[i], 0)
                    drv.dtoh(host + at, staging + at, size, other)
                else:  # DMA a range in, then its scatter beside the next range's DMA
                    drv.htod(staging + at, host + at, size, other)
                    drv.record(events[i], other)
                    drv.wait(main, events[i], 0)
                    triton_copy.launch_raw(plan, main, staging, off, caps, tables, False, chunk_size, 0, n_rows,
                                           (r0, r1), 0, programs)  # fmt: skip
            if to_objects:  # the last DMA joins back
                drv.record(events[pieces], other)
                drv.wait(main, events[pieces], 0)

        triton_copy.compile_all(plan)  # a compile inside the capture would break it
        self._graph = CapturedGraph(context)
        try:
            self._graph.capture(main, enqueue)
        finally:
            for e in events:
                drv.destroy(e)
        copies = self._graph.host_copies(host, self.nbytes)
        if len(copies) != pieces:
            raise CudaError(f"the captured graph has {len(copies)} host copies; {pieces} were enqueued")
        self._copies: list[tuple[HostCopy, int]] = [(c, c.device_address - staging) for c in copies]

    def launch(self, host: int, tables_host: int, start: int) -> None:
        """Move the object at `host` after `start` (an event); `tables_host`: pinned int64s, the block ids then 0
        and the object's capacity (`tables`)."""
        d, stream = self._driver, self.stream
        d.htod(self._tables_ptr, tables_host, (self.n_ids + 2) * 8, stream)
        for copy, at in self._copies:
            self._graph.aim(copy, host + at)
        d.wait(stream, start, 0)
        self._graph.launch(stream)
