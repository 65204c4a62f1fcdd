"""The linker's layer-wise load counter: what SGLang's forward waits on before it reads a layer a load writes.

SGLang's own counter (`LayerWiseLoadCounter`) is completed on the CPU: a forward that waits for a layer blocks its
thread until the thread that saw the copy end has completed the layer, and that thread was itself woken by the end
of the copy: two thread hand-offs after the bytes landed (0.05-0.2 ms each on a GPU host's virtual CPUs). Where a
load's copies run on this process's GPU (a linker in process), this counter makes the forward's stream wait for
their end on the GPU instead, as SGLang's HiCache counter does with its CUDA events: the forward's thread goes on
queueing kernels and no thread waits. The layers are still completed on the CPU as their copies end, and `finish`
reports after the forward a load that did not land, as SGLang's does (SGLang then aborts the batch's loading
requests; the forward ran on what the slots held, as with SGLang's counter). A load through a server, or into CPU
tensors, is waited for on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class CopyEnd(Protocol):
    """The end of a copy on this process's GPU (`kvferry.transfer.TransferHandle`, from `copy_end`)."""

    def wait_on(self, stream: Any = None) -> None:
        """Make ``stream`` wait for the copy's end on the GPU (the CPU goes on)."""
        ...


@dataclass
class _OnDevice:
    """A batch's groups of layers whose copies' ends a stream can wait for (None: a group waited for on the CPU),
    and how many of them each stream already waits for."""

    group_of: list[int]  # layer -> its group
    ends: list[list[CopyEnd] | None]
    ordered: dict[int, int] = field(default_factory=dict)  # stream handle -> groups it waits for


class LoadCounter:
    """SGLang's ``LayerWiseLoadCounter`` calls (``update_producer``, ``set_consumer``, ``complete``, ``fail``,
    ``wait_until``, ``finish``, ``reset``; its CUDA-graph runner reads ``num_layers`` and ``consumer_index``), and
    `on_device`: a batch's groups of layers that the forward's stream waits for on the GPU."""

    def __init__(self, num_layers: int, current_stream: Callable[[], Any] | None = None) -> None:
        self.num_layers = num_layers
        self.producer_index = -1
        self.consumer_index = -1
        self.futures: dict[int, list[Future[None]]] = {}
        self._on_device: dict[int, _OnDevice] = {}
        self._current_stream = current_stream or torch.cuda.current_stream

    def update_producer(self) -> int:
        self.producer_index += 1
        self.futures[self.producer_index] = [Future() for _ in range(self.num_layers)]
        return self.producer_index

    def on_device(self, index: int, groups: Sequence[range], ends: Sequence[list[CopyEnd] | None]) -> None:
        """Batch ``index``'s layers, by ``groups``, land when ``ends`` (by group) have ended on the GPU; a group
        with None is waited for on the CPU (with every group after it)."""
        group_of = [0] * self.num_layers
        for group, layers in enumerate(groups):
            for layer in layers:
                group_of[layer] = group
        self._on_device[index] = _OnDevice(group_of, list(ends))

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int, layer: int) -> None:
        self.futures[index][layer].set_result(None)

    def fail(self, index: int, error: BaseException) -> None:
        for future in self.futures.get(index, ()):
            if not future.done():
                future.set_exception(error)

    def wait_until(self, threshold: int) -> None:
        """The forward is about to read layer ``threshold``: its stream waits for the layer's copies (and those of
        the groups before it) on the GPU, or this thread until they have been completed. A failure is not raised
        here (the forward runs on what the slots hold): `finish` reports it."""
        index = self.consumer_index
        futures = self.futures.get(index)
        if futures is None:
            return
        device = self._on_device.get(index)
        if device is not None and self._order(device, device.group_of[threshold]):
            return
        futures[threshold].exception()

    def finish(self, index: int) -> bool:
        """Wait for every layer of batch ``index`` to be completed; True when all of them landed."""
        futures = self.futures.get(index)
        if futures is None:
            return True
        landed = all(future.exception() is None for future in futures)  # before dropping it: see SGLang's
        del self.futures[index]
        self._on_device.pop(index, None)
        return landed

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
        self.futures.clear()
        self._on_device.clear()

    def _order(self, device: _OnDevice, group: int) -> bool:
        """Order the current stream after the copies of groups up to ``group``; False where one of them is waited
        for on the CPU."""
        wanted = device.ends[: group + 1]
        if any(ends is None for ends in wanted):
            return False
        stream = self._current_stream()
        done = device.ordered.get(stream.cuda_stream, 0)
        for ends in wanted[done:]:
            for end in ends or ():
                end.wait_on(stream)
        device.ordered[stream.cuda_stream] = max(done, group + 1)
        return True
