"""A prefix of pages through kvferry's SGLang linker, as SGLang's unified radix cache drives it, checked.

The pool is a recorded SGLang device pool replayed on the device (`kvferry.bench.sglang_pools`: the buffers an SGLang
worker allocates, no SGLang needed), seen by the linker's own code (`device_kv`), linked to the cache through the
linker's own store (`open_linker_store`: in this process, or a ``kvferry server``). Each round gives the source pages
new random bytes and the prefix new page hashes; a store is an offload of the source pages to its completion; a load is
the scheduler's lookup (untimed, as SGLang's prefix match runs before the batch), then the queued load started with the
batch and waited for through the linker's layer counter as SGLang's forward waits for it (`wait_until` of its last
layer: in process on a GPU the forward's stream waits, and the load ends where that stream may go on); the
counter's `finish` (after the forward in SGLang) must then say it landed. `check_load` compares every destination
page with its source page in every buffer and every other byte with what it held before the load.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvferry.bench.harness import BenchError
from kvferry.bench.sglang_pools import case_of, replay
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.device_pages import device_kv
from kvferry.integrations.sglang.device_pools import KV, kv_pool
from kvferry.integrations.sglang.linker_pools import PoolPages, PoolPlan, layer_groups
from kvferry.integrations.sglang.linker_store import open_linker_store
from kvferry.integrations.sglang.load_counter import LoadCounter
from kvferry.integrations.sglang.page_store import PageKeySpace

POISON = 0xA5
_WAIT_S = 60.0


class LinkerPath:
    """``pages`` pages of a replayed pool stored from scattered source pages and loaded into scattered others."""

    def __init__(
        self, fixture: dict[str, Any], settings: ConnectorSettings, device: str, pages: int, groups: int = 1
    ) -> None:
        self.case = case_of(fixture)
        self.pool = replay(fixture, device)
        self.device = device
        self.buffers = [*self.pool.k_buffer, *self.pool.v_buffer] if self.case.kind == "mha" else self.pool.kv_buffer
        self.kv = device_kv(self.pool)
        self.page = self.kv.block_size
        usable = self.buffers[0].shape[0] // self.page - 1  # page 0 is SGLang's padding page
        if 2 * pages > usable:
            raise BenchError(f"{self.case.name}: {pages} pages stored and {pages} loaded need {2 * pages} of {usable}")
        order = (torch.randperm(usable, generator=torch.Generator().manual_seed(1)) + 1).tolist()
        self.src, self.dst = order[:pages], order[pages : 2 * pages]
        self._src_rows, self._dst_rows = self._rows(self.src), self._rows(self.dst)
        self.nbytes = sum(b[: self.page].numel() * b.element_size() for b in self.buffers) * pages
        self.counter = LoadCounter(len(self.kv.layers))
        self._first_group_ends = layer_groups(len(self.kv.layers), groups)[0][-1]
        space = PageKeySpace(f"bench/{self.case.name}", 1, 0)
        plans = [PoolPlan(kv_pool(self.kv), space)]
        self.store_ = open_linker_store(
            settings, plans, self.page, len(self.kv.layers), self.counter, name="bench", groups=groups
        )
        self.first_layer_s: list[float] = []  # each load's time from its call to its first group landed
        self._index = -1  # the counter's index of the last load
        self._first: tuple[Any, Any] | float = 0.0  # the last load's first group landed: events (GPU), or seconds
        self._generator = torch.Generator(device=device).manual_seed(7)
        self._forward = torch.cuda.Stream() if device == "cuda" else None  # SGLang's forward stream (overlap)
        self._round = 0
        self.keys: list[str] = []
        self._before: list[torch.Tensor] = []

    def _rows(self, pages: list[int]) -> torch.Tensor:
        slots = [p * self.page + t for p in pages for t in range(self.page)]
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def _writers(self) -> list[int]:
        """The streams an offload waits for, as the linker passes them under SGLang's overlap scheduler: the
        current one and a forward stream of its own (`Linker._writers`)."""
        if self._forward is None:
            return []
        return [torch.cuda.current_stream().cuda_stream, self._forward.cuda_stream]

    def next_round(self) -> None:
        """New page hashes for the prefix and new bytes in its source pages."""
        self._round += 1
        self.keys = [f"{self._round:032x}{i:032x}" for i in range(len(self.src))]
        for buffer in self.buffers:
            rows = buffer[self._src_rows]
            noise = torch.randint(0, 256, (rows.numel() * rows.element_size(),), generator=self._generator,
                                  dtype=torch.uint8, device=self.device)  # fmt: skip
            buffer[self._src_rows] = noise.view(buffer.dtype).view(rows.shape)

    def store(self) -> None:
        self.store_.offload([PoolPages(KV, self.keys, self.src)], self._writers())
        deadline = time.monotonic() + _WAIT_S
        while self.store_.completed_offloads() == 0:
            if time.monotonic() > deadline:
                raise BenchError(f"{self.case.name}: an offload did not end within {_WAIT_S:.0f} s")
            time.sleep(0)
        if not self.store_.pop_offload():
            raise BenchError(f"{self.case.name}: the linker did not store the prefix")

    def before_load(self) -> None:
        """The scheduler's part: the destination pages poisoned, the prefix looked up (and locked)."""
        for buffer in self.buffers:
            buffer[self._dst_rows] = torch.full_like(buffer[self._dst_rows].view(torch.uint8), POISON).view(
                buffer.dtype
            )
        self._before = [buffer.view(torch.uint8).clone() for buffer in self.buffers]
        found = self.store_.lookup("bench", self.keys)
        if len(found) != len(self.keys):
            raise BenchError(f"{self.case.name}: {len(found)} of {len(self.keys)} pages found after they were stored")

    def load(self) -> None:
        """As SGLang's scheduler starts a batch's loads and its forward waits for the first group's layers, then
        the last layer: on a GPU in process the wait is the current stream's, and the load ends there (time it with
        `kvferry.bench.timing.gpu_span`); else the host's, and it ends on return."""
        on_gpu = self.device == "cuda"
        start = time.perf_counter()
        began = _event(on_gpu)
        if not self.store_.queue_load("bench", [PoolPages(KV, self.keys, self.dst)]):
            raise BenchError(f"{self.case.name}: the linker refused a load")
        self._index = self.store_.start_loads()
        self.counter.set_consumer(self._index)
        self.counter.wait_until(self._first_group_ends)
        first = _event(on_gpu)
        self._first = (began, first) if on_gpu else time.perf_counter() - start
        self.counter.wait_until(self.counter.num_layers - 1)

    def check_load(self) -> None:
        """The load landed (the counter's `finish`), every destination page holds its source page's bytes, in every
        buffer, and every other byte is unchanged."""
        if not self.counter.finish(self._index):
            raise BenchError(f"{self.case.name}: a load failed (the layer counter's finish)")
        if isinstance(self._first, tuple):  # the first group's end on the forward's stream, by the GPU's clock
            began, first = self._first
            first.synchronize()
            self.first_layer_s.append(began.elapsed_time(first) / 1e3)
        else:
            self.first_layer_s.append(self._first)
        for i, (buffer, before) in enumerate(zip(self.buffers, self._before, strict=True)):
            got = buffer.view(torch.uint8)
            if not torch.equal(got[self._dst_rows], got[self._src_rows]):
                raise BenchError(f"{self.case.name}: buffer {i}: a destination page does not hold its source's bytes")
            got[self._dst_rows] = before[self._dst_rows]
            if not torch.equal(got, before):
                raise BenchError(f"{self.case.name}: buffer {i}: the load wrote outside its destination pages")
            got[self._dst_rows] = got[self._src_rows]

    def close(self) -> None:
        self.store_.close()


def _event(on_gpu: bool) -> Any:
    """A timing event recorded on the current stream (on a GPU; None on the CPU)."""
    if not on_gpu:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
