"""The linker's layer-wise load counter: what SGLang's forward waits on before it reads a layer a load writes.

SGLang's own counter (`LayerWiseLoadCounter`) is completed on the CPU: a forward that waits for a layer blocks its
thread until the thread that saw the copy end has completed the layer, and that thread was itself woken by the end
of the copy: two thread hand-offs after the bytes landed (0.05-0.2 ms each on a GPU host's virtual CPUs). Where a
load's copies run on this process's GPU (a linker in process), this counter makes the forward's stream wait for
their end on the GPU instead, as SGLang's HiCache counter does with its CUDA events: the forward's thread goes on
queueing kernels and no thread waits. The layers are still completed on the CPU as their copies end, and `finish`
reports after the forward a load that did not land, as SGLang's does (SGLang then aborts the batch's loading
requests; the forward ran on what the slots held, as with SGLang's counter). A load through a server, or into CPU
tensors, is waited for on the CPU: a server's moves by the waiting thread itself where it can (`on_host`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


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


@dataclass
class _Batch:
    """A batch's layers completed so far, the error that failed the rest, its copies on the GPU, and what a thread
    about to wait for a layer on the CPU does first (`on_host`)."""

    landed: list[bool]
    error: BaseException | None = None
    on_device: _OnDevice | None = None
    before_waiting: Callable[[int], None] | None = None

    def settled(self, layer: int) -> bool:
        """``layer`` was completed, or the batch failed (SGLang's future of the layer is done)."""
        return self.landed[layer] or self.error is not None

    def ended(self) -> bool:
        return self.error is not None or all(self.landed)


class LoadCounter:
    """SGLang's ``LayerWiseLoadCounter`` calls (``update_producer``, ``set_consumer``, ``complete``, ``fail``,
    ``wait_until``, ``finish``, ``reset``; its CUDA-graph runner reads ``num_layers`` and ``consumer_index``), and
    `on_device`: a batch's groups of layers that the forward's stream waits for on the GPU.

    SGLang's counter holds a `Future` per layer of every batch, each made and then resolved with a lock and a
    condition of its own: for a 61-layer model ~0.2 ms of a load's host path on a CPU (measured through the linker),
    more on a GPU host's virtual CPUs. Here a batch is a row of flags under one condition, a group of layers
    completed under one hold of it with one wake-up (`complete_layers`); the linker adds a batch once its copies
    are under way."""

    def __init__(self, num_layers: int, current_stream: Callable[[], Any] | None = None) -> None:
        self.num_layers = num_layers
        self.producer_index = -1
        self.consumer_index = -1
        self._batches: dict[int, _Batch] = {}
        self._changed = threading.Condition()
        self._current_stream = current_stream or torch.cuda.current_stream

    def update_producer(self) -> int:
        self.producer_index += 1
        self._batches[self.producer_index] = _Batch([False] * self.num_layers)
        return self.producer_index

    def on_device(self, index: int, groups: Sequence[range], ends: Sequence[list[CopyEnd] | None]) -> None:
        """Batch ``index``'s layers, by ``groups``, land when ``ends`` (by group) have ended on the GPU; a group
        with None is waited for on the CPU (with every group after it)."""
        group_of = [0] * self.num_layers
        for group, layers in enumerate(groups):
            for layer in layers:
                group_of[layer] = group
        self._batches[index].on_device = _OnDevice(group_of, list(ends))

    def on_host(self, index: int, before_waiting: Callable[[int], None]) -> None:
        """A thread that is to wait on the CPU for a layer of batch ``index`` first calls ``before_waiting(layer)``
        (the linker's: the moves of that layer's group and those before it waited for on that thread, their done
        flags looked at there, rather than for another thread to see them end and wake it)."""
        self._batches[index].before_waiting = before_waiting

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int, layer: int) -> None:
        self.complete_layers(index, (layer,))

    def complete_layers(self, index: int, layers: Iterable[int]) -> None:
        """`complete` of each of ``layers``, their waiters woken once."""
        with self._changed:
            landed = self._batches[index].landed
            for layer in layers:
                landed[layer] = True
            self._changed.notify_all()

    def fail(self, index: int, error: BaseException) -> None:
        """The layers of batch ``index`` not completed yet fail with ``error`` (a later failure changes nothing)."""
        with self._changed:
            batch = self._batches.get(index)
            if batch is not None and batch.error is None and not all(batch.landed):
                batch.error = error
                self._changed.notify_all()

    def landed(self, index: int, layer: int) -> bool:
        """Whether ``layer`` of batch ``index`` (one not finished) has been completed."""
        batch = self._batches.get(index)
        return batch is not None and batch.landed[layer]

    def wait_until(self, threshold: int) -> None:
        """The forward is about to read layer ``threshold``: its stream waits for the layer's copies (and those of
        the groups before it) on the GPU, or this thread until they have been completed. A failure is not raised
        here (the forward runs on what the slots hold): `finish` reports it."""
        batch = self._batches.get(self.consumer_index)
        if batch is None:
            return
        device = batch.on_device
        if device is not None and self._order(device, device.group_of[threshold]):
            return
        if batch.before_waiting is not None and not batch.settled(threshold):
            try:
                batch.before_waiting(threshold)
            except Exception:  # the batch's own outcome says how its moves went
                log.debug("kvferry: waiting for a load's moves on the forward's thread", exc_info=True)
        with self._changed:
            self._changed.wait_for(lambda: batch.settled(threshold))

    def finish(self, index: int) -> bool:
        """Wait for every layer of batch ``index`` to be completed (or the batch to fail); True when all of them
        landed. The batch is forgotten then."""
        batch = self._batches.get(index)
        if batch is None:
            return True
        with self._changed:
            self._changed.wait_for(batch.ended)
        del self._batches[index]
        return batch.error is None

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
        self._batches.clear()

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
